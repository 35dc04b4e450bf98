"""The engine as the server sees it: :class:`llmlib.engine.AsyncLLM`, through a narrow interface.

:class:`EngineClient` gives the server the tokenizer, the context length, schema checks and one
stream of :class:`~llmlib.engine.RequestOutput`\\ s per request; the engine's refusals become
the server's errors (:class:`~llmlib.engine.QueueFull` the 503, a ValueError at submission a 400).
Aborting a stream (:func:`merged` does when it is closed) frees the request's KV blocks, so a
client that leaves stops costing anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from llmlib.engine import AsyncLLM, QueueFull, RequestOutput, RequestStream
from llmlib.sampling import SamplingParams
from llmlib.serve.protocol import APIError, bad


def queue_full(e: Exception) -> APIError:
    return APIError(
        503, f"the engine's queue is full: {e}", code="queue_full", type_="server_overloaded"
    )


class EngineClient:
    """The server's view of an :class:`AsyncLLM`."""

    def __init__(self, engine: AsyncLLM):
        if not isinstance(engine, AsyncLLM):
            raise TypeError(
                f"EngineClient serves an llmlib.engine.AsyncLLM, got {type(engine).__name__}"
            )
        if engine.tokenizer is None:
            raise ValueError("EngineClient: the engine has no tokenizer; give AsyncLLM one")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.context_len = engine.max_model_len
        self.vocab_size = min(engine.llm.config.vocab_size, self.tokenizer.vocab_size)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it count as such only when allowed
        (otherwise one is a ValueError)."""
        if allow_special:
            return list(self.tokenizer.encode(text, allowed_special="all"))
        return list(self.tokenizer.encode(text))

    def bos(self) -> list[int]:
        """The BOS a raw prompt starts with, if the tokenizer asks for one."""
        tok = self.tokenizer
        return [tok.bos_id] if getattr(tok, "add_bos", False) and tok.bos_id is not None else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def token_str(self, token_id: int) -> str:
        """One token's text (a piece of a multi-byte character shows as U+FFFD)."""
        return self.tokenizer.id_to_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.id_to_bytes(token_id))

    def check_schema(self, schema: dict) -> None:
        """Compile a JSON schema for structured output now (ValueError saying why it cannot be)."""
        self.engine.llm.grammars().grammar(schema)

    def in_flight(self) -> int:
        return self.engine.num_in_flight

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue a request now; iterate the result for its outputs, ``abort()`` it to cancel.

        Raises :class:`APIError`: 503 when the engine's queue is full, 400 when the engine
        refuses the request."""
        try:
            return self.engine.submit(prompt_ids, params, request_id=request_id)
        except QueueFull as e:
            raise queue_full(e) from e
        except (ValueError, TypeError) as e:
            raise bad(f"the engine refused the request: {e}") from e


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(i, output)`` from several requests' streams as they come; closing it aborts them all."""
    if len(streams) == 1:  # the usual case: no task per output
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, s in enumerate(streams):
            pending[asyncio.ensure_future(s.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                i = pending.pop(f)
                try:
                    out = f.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for f in pending:
            f.cancel()
        for s in streams:
            s.abort()


async def aclose(agen: Any) -> None:
    """Close an async generator, ignoring what it raises on the way out."""
    close = getattr(agen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            pass
