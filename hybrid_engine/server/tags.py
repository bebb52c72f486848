"""Tags in generated text that a streamed reply may cut anywhere ("<think>", "<tool_call>"):
the parsers of replies (reasoning.py, tool_calls.py) hold back what could still be one."""


def tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may be cut
    mid-tag, to be held back until the next piece says)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
