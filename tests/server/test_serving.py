"""Server-sent events as `serving.py` writes them."""
import json

import httpx
import pytest
from pydantic import BaseModel

from hybrid_engine.server.serving import _sse

# Every character Python's str.splitlines ends a line at (httpx's `aiter_lines` does the same).
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


class _Delta(BaseModel):
    text: str


@pytest.mark.parametrize("payload", [_Delta(text=f"a{LINE_BREAKS}b"), {"text": f"a{LINE_BREAKS}b"}])
def test_an_event_is_one_line_for_every_line_reader(payload):
    """Text that holds line separators JSON may leave raw (U+0085, U+2028, U+2029) still
    makes one `data:` line, which a line-splitting client (httpx) reads back whole."""
    event = _sse(payload)
    assert event.startswith("data: ") and event.endswith("\n\n")
    decoder_lines = list(httpx.Response(200, content=event.encode()).iter_lines())
    assert decoder_lines == [event.removesuffix("\n\n"), ""]
    assert json.loads(decoder_lines[0].removeprefix("data: ")) == {"text": f"a{LINE_BREAKS}b"}
