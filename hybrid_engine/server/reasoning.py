"""Reasoning parsers (`--reasoning-parser`): a chat reply's thinking, between "<think>" and
"</think>", goes to `message.reasoning` (streamed as `delta.reasoning`), the rest to
`content`, as vLLM's reasoning parsers of the same names answer.

Whether a reply starts inside its thinking is read off the template's generation prompt
(or a continued final message), not guessed from the output, and never from what users
wrote: templates that think by default end the prompt with an open "<think>" (DeepSeek-R1,
Nemotron-Nano-v2 and Nemotron-3 with thinking on), and with thinking off they close it
there ("<think></think>": Nemotron's "/no_think" or `enable_thinking: false`, Qwen3's
`enable_thinking: false`), so the reply is all content. A prompt that leaves no block open
(Qwen3 with thinking on) lets the reply open one itself: a reply that begins with "<think>"
(after white space) thinks until "</think>", any other is content. Thinking ends at the
first "</think>"; a reply cut off before it (a token limit) is all reasoning. The tags of
that first block are in neither part (later ones are content).

The stream and the whole reply split the same way: streamed deltas hold back text that
could still be the start of a tag, and the whole reply is the same parser fed once.
"""
import dataclasses
from typing import Literal

from hybrid_engine.server.tags import tag_prefix_length

START, END = "<think>", "</think>"
TAGS = (START, END)
# vLLM's parser names for models that think between these tags; they all split as above.
REASONING_PARSERS = ("deepseek_r1", "nemotron_v3", "qwen3")

Part = Literal["undecided", "reasoning", "content"]


def opens_in_reasoning(reply_prefix: str) -> bool:
    """Whether a reply that continues `reply_prefix` (`ChatPrompt.reply_prefix`: the
    template's generation prompt, or a continued message) starts inside a thinking block:
    the prefix's last tag is an open one."""
    return reply_prefix.rfind(START) > reply_prefix.rfind(END)


@dataclasses.dataclass
class ReasoningSplit:
    """One reply's text, split as it arrives into reasoning and content (`feed`)."""

    part: Part  # where the next text goes ("undecided": the reply may still open a block)
    include_reasoning: bool = True  # false: the reasoning is dropped (vLLM's `include_reasoning`)
    held: str = ""  # text that could still be (the start of) a tag
    at_start: bool = True  # nothing has gone to the reasoning yet (a leading "<think>" is dropped)

    @classmethod
    def for_reply(cls, reply_prefix: str, include_reasoning: bool = True) -> "ReasoningSplit":
        """The split for a reply that continues `reply_prefix` (`opens_in_reasoning`)."""
        return cls("reasoning" if opens_in_reasoning(reply_prefix) else "undecided", include_reasoning)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning (empty if not included) and the content that `text`, the reply's
        next piece, adds (`final`: the reply ends with it, so nothing is held back)."""
        reasoning, content = self._split(text, final)
        return reasoning if self.include_reasoning else "", content

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = content = ""
        while text:
            if self.part == "content":
                content, text = content + text, ""
                continue
            if self.at_start:  # (an undecided reply is always at its start)
                opened = text.lstrip()
                if opened.startswith(START):  # the reply opens a block, or repeats the prompt's "<think>"
                    self.part, text = "reasoning", opened[len(START):]
                    continue
                if START.startswith(opened) and not final:
                    self.held, text = text, ""  # white space, or a piece of "<think>": wait
                    continue
                if self.part == "undecided":
                    self.part = "content"
                    continue
            end = text.find(END)
            if end >= 0:
                reasoning += text[:end]
                self.part, text = "content", text[end + len(END):]
                continue
            keep = 0 if final else tag_prefix_length(text, END)
            reasoning, self.held, text = reasoning + text[:len(text) - keep], text[len(text) - keep:], ""
            self.at_start = self.at_start and not reasoning
        return reasoning, content
