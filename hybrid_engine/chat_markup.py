"""Where a rendered chat prompt's special tokens may come from: the chat template's own
markup, never a message's text, while the template reads the real texts
(`hybrid_engine/chat_template.py` renders; this module tells markup from text and encodes).

A second rendering wraps each text in markers ("<open>text<close>": private-use characters
around a random nonce drawn per conversation). Its text outside the markers is the
template's own; the real rendering must be that markup with each marked text in place
(stripped of outer white space if the template trims it), and only special tokens wholly
inside markup are parsed as such. A template's rewrite of a text that forms a special
token's characters (Nemotron's templates delete "/think", which turns "<SPECIAL_/think11>"
into "<SPECIAL_11>") stays characters.

A text goes through the template as an opaque placeholder instead (tokenized as plain text,
so the template does not act on it) where that cannot be told safely:
- a text that holds a special token's text itself (a template could write a piece of it
  on its own, with no marker around it);
- a text whose markers the template breaks, unless what it keeps is a head or a tail of the
  text: a template that keeps what follows "</think>" (old reasoning dropped) is then given
  that part, which must render the same;
- a text that the marked rendering leaves out (a template that writes only pieces from
  inside it would write them with no marker);
- every text, where the marked rendering takes another branch than the real one (a template
  that tests `content.startswith(...)`), where the template refuses the marked rendering,
  or where the markup's special tokens change when the texts' characters that begin special
  tokens are broken up (a template that writes a piece from inside a text apart from the
  text itself, and so could form a special token of it with no marker around).
Empty and white-space texts go through as they are: they hold no special token, and a
marked blank would not test as blank. A placeholder that comes out of the template cut, or
any of the reserved characters in the markup, is refused (ParameterError): no piece of one
may reach the model, and markup fields may not hold them (`RESERVED_CHARACTERS`).

Encoding: where no special token's text overlaps a message's text, the prompt is encoded
whole, as transformers encodes a rendered chat, and checked (a tokenizer that normalizes
before matching special tokens could still find one in a text); otherwise each special
token wholly inside markup is its token and all other text is encoded as plain text.
"""
import bisect
import dataclasses
import functools
import logging
import math
import os
import re
import secrets
from collections.abc import Callable
from typing import Any

from hybrid_engine.prompts import check_unicode, encode_prompt
from hybrid_engine.sampling_params import ParameterError

logger = logging.getLogger(__name__)

_PLACEHOLDER, _OPEN, _CLOSE, _END, _BREAK = "\ue000", "\ue001", "\ue002", "\ue003", "\ue004"
# What markup fields (names, tool calls, template variables) may not hold: the markers'
# characters, so that no piece of a marker in the markup can be the client's.
RESERVED_CHARACTERS = re.compile("[\ue000-\ue004]")
# How far a kept head or tail may reach into the markup beside it: the text the common
# prefix or suffix found can run on over characters that the markup happens to share
# (DeepSeek-R1: "</think>" and "<｜Assistant｜>" both end in ">").
_CUT_SLACK = 64

Render = Callable[[list[str]], str]  # the template rendered with these texts (ParameterError if it cannot)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A stretch of the rendered prompt: the template's markup, or text that came from a
    message (`from_text`)."""
    text: str
    from_text: bool


@dataclasses.dataclass(frozen=True)
class _Marked:
    """A stretch of the marked rendering: markup (`index` None), or the text between text
    `index`'s markers."""
    text: str
    index: int | None


class _Tags:
    """The markers and placeholders of one conversation's renderings."""

    def __init__(self) -> None:
        # Decimal: a template that upper-cases a text keeps it.
        self.nonce = str(secrets.randbelow(10 ** 18))

    def tag(self, kind: str, index: int) -> str:
        """Text `index`'s marker (`_OPEN`, `_CLOSE`) or placeholder (`_PLACEHOLDER`)."""
        return f"{kind}{self.nonce}-{index}{_END}"

    def pattern(self, kinds: str) -> re.Pattern[str]:
        """Finds the tags of `kinds` (characters), capturing the kind and the index."""
        return re.compile(f"([{kinds}]){self.nonce}-([0-9]+){_END}")


def prompt_pieces(render: Render, texts: list[str], special_tokens: re.Pattern[str],
                  special_starts: str) -> list[Piece]:
    """The real rendering of `texts`, cut into markup and text pieces (module docstring).
    `special_starts`: the characters that begin special tokens. ParameterError where
    transformers cannot render the texts either."""
    real = render(texts)  # transformers' own rendering (its refusals are the request's)
    tags = _Tags()
    plain = {i for i, text in enumerate(texts) if not text.strip()}
    opaque = {i for i, text in enumerate(texts) if i not in plain and special_tokens.search(text)}
    # A kept head or tail can change the template's branches: then a second try without,
    # from the opaque texts the first one found (a text whose markers break without a cut
    # being found is opaque either way).
    for cuts in (True, False):
        try:
            marked = _marked(render, texts, plain, opaque, tags, cuts)
        except ParameterError:  # the template refuses a marked text (a continued message it must find, say)
            continue
        opaque = marked.opaque
        pieces = _align(marked.pieces, render(_stand_ins(texts, opaque, tags)) if opaque else real, marked.ends)
        if pieces is not None and _markup_specials(marked.pieces, special_tokens) == _broken_up_markup_specials(
                render, marked, tags, special_tokens, special_starts):
            return _with_placeholders_filled(pieces, texts, tags)
    everything = set(range(len(texts))) - plain
    rendering = render(_stand_ins(texts, everything, tags))
    _warn_once("the chat template takes another branch for marked message texts: every text of such a "
               "conversation reaches it as a placeholder (hybrid_engine/chat_markup.py)")
    return _with_placeholders_filled([Piece(rendering, False)], texts, tags)


def encode(pieces: list[Piece], tokenizer: Any, special_tokens: re.Pattern[str]) -> list[int]:
    """The token ids of the pieces' text (module docstring, "Encoding")."""
    for piece in pieces:
        check_unicode(piece.text, "messages")
    text = "".join(piece.text for piece in pieces)
    markup_spans, at = [], 0
    for piece in pieces:
        if not piece.from_text:
            markup_spans.append((at, at + len(piece.text)))
        at += len(piece.text)
    # Every occurrence, overlapping ones included: a tokenizer's other added tokens could
    # make it split the text elsewhere than one left-to-right scan does.
    overlapping = re.compile(f"(?=({special_tokens.pattern}))")
    if all(_within(markup_spans, found.start(1), found.end(1)) for found in overlapping.finditer(text)):
        try:
            whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets: encoded piecewise below
            whole = None
        if whole is not None:
            special_ids = set(tokenizer.all_special_ids) | {
                i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
            if all(_within(markup_spans, start, end) for token, (start, end)
                   in zip(whole["input_ids"], whole["offset_mapping"]) if token in special_ids):
                return list(whole["input_ids"])
    ids: list[int] = []
    plain = ""  # text waiting to be encoded as plain text, up to the next markup special token
    for piece in pieces:
        if piece.from_text:
            plain += piece.text
            continue
        at = 0
        for special in special_tokens.finditer(piece.text):
            plain += piece.text[at:special.start()]
            ids += _plain_ids(plain, tokenizer) + [tokenizer.convert_tokens_to_ids(special.group())]
            plain, at = "", special.end()
        plain += piece.text[at:]
    return ids + _plain_ids(plain, tokenizer)


def _within(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) lies inside one of the (sorted, disjoint) spans."""
    at = bisect.bisect_right(spans, (start, math.inf)) - 1
    return at >= 0 and end <= spans[at][1]


def _plain_ids(text: str, tokenizer: Any) -> list[int]:
    """`text` encoded with special-token strings as plain text."""
    return encode_prompt(text, tokenizer, "messages", add_special_tokens=False, split_special_tokens=True) \
        if text else []


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Log `message` the first time only: a template's way with texts repeats with every
    request."""
    logger.warning(message)


def _stand_ins(texts: list[str], opaque: set[int], tags: _Tags) -> list[str]:
    """What the template gets for each text where it is not marked: the text, or the
    placeholder of an opaque one."""
    return [tags.tag(_PLACEHOLDER, i) if i in opaque else text for i, text in enumerate(texts)]


@dataclasses.dataclass
class _MarkedRendering:
    """A marked rendering whose markers all pair up, and what it took to get there."""
    pieces: list[_Marked]
    texts: list[str]  # what each text went in as: itself, or the head or tail of it the template keeps
    ends: dict[int, str]  # which end ("head", "tail") a text cut to a part kept
    plain: set[int]  # texts that went in unmarked (blank ones)
    opaque: set[int]  # texts that went in as placeholders

    def inputs(self, tags: _Tags, texts: list[str] | None = None) -> list[str]:
        """The texts as this rendering gives them to the template (`texts` in place of its
        own, marked the same way)."""
        return [tags.tag(_OPEN, i) + text + tags.tag(_CLOSE, i) if i not in self.plain and i not in self.opaque
                else stand_in for i, (text, stand_in) in
                enumerate(zip(texts or self.texts, _stand_ins(texts or self.texts, self.opaque, tags)))]


def _marked(render: Render, texts: list[str], plain: set[int], opaque: set[int], tags: _Tags,
            cuts: bool) -> _MarkedRendering:
    """The marked rendering once every text's markers pair up. With `cuts`, a text of which
    the template keeps only a head or tail (it cut the marker off the other end) is rendered
    as that part instead, once (empty and unmarked if it is blank); texts whose markers still break,
    or which the rendering leaves out, become opaque."""
    marked = _MarkedRendering([], list(texts), {}, set(plain), set(opaque))
    while True:
        rendering = render(marked.inputs(tags))
        marked.pieces, broken = _parse_marked(rendering, tags, marked.texts)
        # A text with no marker in the rendering: either the template leaves it out (then
        # its placeholder is left out too) or it writes only pieces from inside it.
        written = {int(found.group(2)) for found in tags.pattern(_OPEN + _CLOSE).finditer(rendering)}
        missing = set(range(len(texts))) - marked.plain - marked.opaque - written
        if not broken and not missing:
            return marked
        marked.opaque |= missing
        for i, (end, part) in broken.items():
            if cuts and part is not None and i not in marked.ends:
                if not part.strip():
                    # Unmarked (a marked blank would not test as blank), and empty: the
                    # white space found may be the markup's beside the cut, not the text's.
                    part = ""
                    marked.plain.add(i)
                marked.texts[i], marked.ends[i] = part, end
            else:
                marked.opaque.add(i)
                _warn_once("the chat template cuts or rewrites a message's text so that its markers break: such a "
                           "text reaches it as a placeholder (hybrid_engine/chat_markup.py)")


def _parse_marked(rendering: str, tags: _Tags, texts: list[str]) -> tuple[list[_Marked], dict[int, tuple]]:
    """The marked rendering as markup and text pieces, and the texts whose markers do not
    pair up, each with the end of its text that the rendering seems to keep ("head" or
    "tail", and the part; None if it is neither)."""
    marked: list[_Marked] = []
    broken: dict[int, tuple[str, str | None]] = {}
    inside, start, at = None, 0, 0

    def lone_open(index: int, end: int) -> None:  # the text after the marker is the text's head
        head = os.path.commonprefix([rendering[start:end], texts[index]])
        broken.setdefault(index, ("head", head if len(head) < len(texts[index]) else None))

    for found in tags.pattern(_OPEN + _CLOSE).finditer(rendering):
        kind, index = found.group(1), int(found.group(2))
        if kind == _CLOSE and inside == index:
            marked.append(_Marked(rendering[start:found.start()], index))
            inside = None
        elif kind == _OPEN:
            if inside is None:
                marked.append(_Marked(rendering[at:found.start()], None))
            else:
                lone_open(inside, found.start())
            inside, start = index, found.end()
        else:  # a close marker alone: the text before it is the text's tail
            if inside is not None:
                lone_open(inside, found.start())
                inside = None
            tail = os.path.commonprefix([rendering[at:found.start()][::-1], texts[index][::-1]])[::-1]
            broken.setdefault(index, ("tail", tail if len(tail) < len(texts[index]) else None))
        at = found.end()
    if inside is not None:
        lone_open(inside, len(rendering))
    marked.append(_Marked(rendering[at:], None))
    return [piece for piece in marked if piece.text or piece.index is not None], broken


def _align(marked: list[_Marked], real: str, ends: dict[int, str]) -> list[Piece] | None:
    """`real` cut into the marked rendering's pieces, each text piece as it is or short of
    white space at either end (a template that trims texts, all white space or only
    newlines), a kept tail or head also short of up to _CUT_SLACK characters at its cut end;
    None if the markup does not match (the marked rendering took another branch). A depth-
    first search over those choices, each (piece, position) tried once; a piece's choices
    are listed when the search first reaches it (most pieces match as they are)."""
    choices: dict[int, list[str]] = {}
    chosen: list[str] = []
    starts, tried = [0], [0]
    dead: set[tuple[int, int]] = set()
    while starts:
        i, at = len(chosen), starts[-1]
        if i == len(marked) and at == len(real):
            return [Piece(text, piece.index is not None) for text, piece in zip(chosen, marked)]
        if i < len(marked) and i not in choices:
            piece = marked[i]
            choices[i] = [piece.text] if piece.index is None else _variants(piece.text, ends.get(piece.index))
        if i < len(marked) and tried[-1] < len(choices[i]):
            text = choices[i][tried[-1]]
            tried[-1] += 1
            if real.startswith(text, at) and (i + 1, at + len(text)) not in dead:
                chosen.append(text)
                starts.append(at + len(text))
                tried.append(0)
            continue
        dead.add((i, at))
        starts.pop()
        tried.pop()
        if chosen:
            chosen.pop()
    return None


def _variants(text: str, end: str | None) -> list[str]:
    """What a text piece may read as in the real rendering (`_align`), as it is first."""
    shortened = [text]
    if end == "tail":
        shortened += [text[k:] for k in range(1, min(len(text), _CUT_SLACK) + 1)]
    elif end == "head":
        shortened += [text[:len(text) - k] for k in range(1, min(len(text), _CUT_SLACK) + 1)]
    variants = []
    for part in shortened:
        lead, trail = len(part) - len(part.lstrip()), len(part) - len(part.rstrip())
        variants += [part[a:len(part) - b] for a in _trim_lengths(lead) for b in _trim_lengths(trail)
                     if a + b <= len(part)]
    return list(dict.fromkeys(variants))


def _trim_lengths(run: int) -> list[int]:
    """How much of a run of `run` white-space characters a template may have trimmed: none,
    some (up to 16: "\n" of "\n  " by `strip('\n')`), or all."""
    return sorted({*range(min(run, 16) + 1), run})


def _markup_specials(marked: list[_Marked], special_tokens: re.Pattern[str]) -> list[str]:
    """The special tokens' texts in the markup of a marked rendering, in order."""
    return [found.group() for piece in marked if piece.index is None for found in special_tokens.finditer(piece.text)]


def _broken_up_markup_specials(render: Render, marked: _MarkedRendering, tags: _Tags,
                               special_tokens: re.Pattern[str], special_starts: str) -> list[str] | None:
    """The markup's special tokens in the marked rendering once every character of the texts
    that begins a special token is followed by _BREAK (None if the markers then break or the
    template refuses it). Where the template writes a piece from inside a text apart from
    the text itself, with no marker, a special token formed of that piece is broken up here
    and not in the marked rendering, so the two lists differ."""
    if not special_starts:
        return _markup_specials(marked.pieces, special_tokens)
    breaker = re.compile(f"([{re.escape(special_starts)}])")
    try:
        rendering = render(marked.inputs(tags, [breaker.sub(rf"\1{_BREAK}", text) for text in marked.texts]))
    except ParameterError:
        return None
    pieces, broken = _parse_marked(rendering, tags, marked.texts)
    return None if broken else _markup_specials(pieces, special_tokens)


def _with_placeholders_filled(pieces: list[Piece], texts: list[str], tags: _Tags) -> list[Piece]:
    """The pieces with each placeholder in the markup replaced by its text, as a text piece.
    ParameterError if a placeholder came out of the template cut or changed: the text cannot
    be put back, and no piece of a placeholder may reach the model."""
    filled = []
    placeholder = tags.pattern(_PLACEHOLDER)
    for piece in pieces:
        if piece.from_text:
            filled.append(piece)
            continue
        at = 0
        for found in placeholder.finditer(piece.text):
            filled += [Piece(piece.text[at:found.start()], False), Piece(texts[int(found.group(2))], True)]
            at = found.end()
        filled.append(Piece(piece.text[at:], False))
    for piece in filled:
        if not piece.from_text and (RESERVED_CHARACTERS.search(piece.text) or tags.nonce in piece.text):
            raise ParameterError("messages", "messages: the chat template cuts or rewrites a message's text in a way "
                                             "that leaves its text and the template's markup apart from each other "
                                             "unknown; send the prompt to /v1/completions rendered instead")
    return [piece for piece in filled if piece.text or piece.from_text]
