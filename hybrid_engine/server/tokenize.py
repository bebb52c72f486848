"""POST /tokenize and /detokenize, as vLLM's server has them: a prompt's or a chat's token
ids exactly as the generation endpoints would build them (chat: the same template
rendering, special-token guards included), and token ids back to text.

Their bodies live here rather than in protocol.py: they are these two endpoints' alone.
"""
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import Response

from hybrid_engine.prompts import encode_prompt
from hybrid_engine.server.bodies import validated
from hybrid_engine.server.chat import ChatHandler
from hybrid_engine.server.errors import APIError, invalid_input
from hybrid_engine.server.protocol import StrictModel, TemplateOptions, UnicodeStr


class TokenizeRequest(TemplateOptions):
    """POST /tokenize: either `prompt` (text, as /v1/completions encodes it) or `messages`
    (as /v1/chat/completions renders them, with the same template options)."""

    model: str | None = None
    prompt: UnicodeStr | None = None
    add_special_tokens: bool = True  # (prompt only: a chat template writes its own)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "prompt or messages: give exactly one of them",
                                      {"param": "prompt"})
        return self


class TokenizeResponse(BaseModel):
    """The token ids, their count, the context length, and (if asked) each id's vocabulary string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    """POST /detokenize: token ids to decode."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The decoded text (special tokens included, as vLLM's)."""

    prompt: str


class TokenizeHandler:
    """Serves /tokenize and /detokenize on the chat handler's tokenizer lanes, model check
    and template rendering, so a count here is the count generation would see."""

    def __init__(self, chat: ChatHandler):
        self.chat = chat

    async def tokenize(self, raw: bytes, content_type: str | None) -> Response:
        """Validate the body and answer its token ids (on a tokenizer lane)."""
        return await self.chat.tokenizer_thread.run(self._tokenize, raw, content_type, body_bytes=len(raw))

    async def detokenize(self, raw: bytes, content_type: str | None) -> Response:
        """Validate the body and answer the text of its token ids (on a tokenizer lane)."""
        return await self.chat.tokenizer_thread.run(self._detokenize, raw, content_type, body_bytes=len(raw))

    def _tokenize(self, raw: bytes, content_type: str | None) -> Response:
        request = validated(TokenizeRequest, raw, content_type)
        self.chat.check_model(request.model)
        tokenizer = self._tokenizer("prompt" if request.prompt is not None else "messages")
        if request.messages is not None:
            ids = self.chat.encode_messages(request).token_ids
        else:
            try:
                ids = encode_prompt(request.prompt, tokenizer, "prompt", request.add_special_tokens)
            except ValueError as exc:
                raise invalid_input(exc) from exc
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=self.chat.info.max_request_tokens, tokens=ids,
                                token_strs=strs)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    def _detokenize(self, raw: bytes, content_type: str | None) -> Response:
        request = validated(DetokenizeRequest, raw, content_type)
        self.chat.check_model(request.model)
        tokenizer = self._tokenizer("tokens")
        vocab_size = self.chat.info.limits.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(f"tokens: token id {bad} is out of vocabulary (vocab_size {vocab_size})", param="tokens",
                           code="invalid_value")
        # Ids of the model's padded vocabulary past the tokenizer's have no text.
        body = DetokenizeResponse(prompt=tokenizer.decode([t for t in request.tokens if t < len(tokenizer)]))
        return Response(body.model_dump_json(), media_type="application/json")

    def _tokenizer(self, param: str) -> Any:
        tokenizer = self.chat.tokenizer_thread.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer: the server takes and returns token ids only", param=param)
        return tokenizer
