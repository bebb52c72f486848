"""Structured outputs: grammars (regex, JSON schema, any JSON object, a choice of strings)
compiled to byte automata, and the token masks that keep a request's output inside them
(`grammar.py` is what the engine uses; docs/structured_outputs.md)."""
