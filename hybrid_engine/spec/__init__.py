"""Speculative decoding: the configuration, the draft proposers and the `Drafter` the
scheduler asks for each verify row's drafts (docs/speculative.md)."""
