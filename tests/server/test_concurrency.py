"""Many concurrent streaming clients (AsyncOpenAI) all complete, with deterministic greedy text."""
import asyncio

import openai

from tests.server.conftest import Server, wait_until

NUM_STREAMS = 64
MAX_TOKENS = 6


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
    """(text, finish reason, completion tokens) of one streamed greedy completion."""
    stream = await client.completions.create(
        model="hybrid-engine/embedded-tiny", prompt=f"client {i % 8}", max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reason, tokens = "", None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, reason, tokens


def test_64_concurrent_streams_complete(server: Server):
    """64 concurrent AsyncOpenAI streams all finish, greedy texts agree per prompt."""
    async def run() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(run())
    assert all(reason == "length" and tokens == MAX_TOKENS for _, reason, tokens in results)
    # Output independence: the same prompt gives the same greedy text whatever the batch.
    by_prompt: dict[int, set[str]] = {}
    for i, (text, _, _) in enumerate(results):
        by_prompt.setdefault(i % 8, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values())
    wait_until(server.idle_and_free, what="all resources back in their pools")
