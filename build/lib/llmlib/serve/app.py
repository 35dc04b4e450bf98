"""An OpenAI-compatible HTTP server on the batching engine (``llmlib serve``).

Every request becomes one sequence in the engine of chapter 10; the engine's loop batches all of
them into shared forward passes, and this module only translates: JSON in, validated
:class:`~llmlib.sampling.SamplingParams` and token ids to the engine, tokens back out as one JSON
body or as server-sent events (``data: {...}`` lines, then ``data: [DONE]``), the wire format the
``openai`` client speaks.

What a public endpoint has to get right, beyond the happy path:

* it binds to 127.0.0.1 unless told otherwise: a model server is not something to expose by accident;
* every request is bounded: prompt characters, prompt tokens against the context, ``max_tokens``
  against what the context has left, ``n`` = 1; a bad request gets a 4xx with an OpenAI-style error
  body naming the field, and nothing from a request is ever evaluated;
* when too many requests are in flight it says 503 at once instead of queueing without limit;
* a client that goes away mid-stream has its request aborted, so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlib.serve.client import Delta, EngineClient, _aclose
from llmlib.serve.protocol import (
    APIError,
    Limits,
    ParsedRequest,
    QueueFullError,
    RequestParser,
    _bad,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


# ---- the app --------------------------------------------------------------------------------------


def create_app(
    engine: Any,
    model_name: str,
    *,
    tokenizer: Any = None,
    context_len: int | None = None,
    limits: Limits | None = None,
    max_queue: int | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A FastAPI app serving ``engine`` under the model id ``model_name``.

    ``engine`` is an :class:`llmlib.engine.AsyncLLM` (or an :class:`EngineClient`). Tests build the app
    around a small random-weight model; ``llmlib serve`` around SmolLM2.
    """

    client = (
        engine if isinstance(engine, EngineClient) else EngineClient(engine, tokenizer, context_len)
    )
    limits = limits or Limits()
    if max_queue is not None:
        limits.max_queue = max_queue
    parser = RequestParser(client, {model_name, *aliases}, limits)
    app = FastAPI(
        title="llmlib", description="An OpenAI-compatible server on llmlib's batching engine"
    )
    app.state.client, app.state.limits = client, limits
    app.state.in_flight = 0
    created = int(time.time())

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(
            APIError(
                exc.status_code,
                str(exc.detail),
                code="not_found" if exc.status_code == 404 else None,
            )
        )

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:  # never a bare traceback
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Any:
        thread = getattr(client.engine, "_thread", None)  # AsyncLLM's stepping thread, once started
        if thread is not None and not thread.is_alive():
            return error(APIError(503, "the engine's thread has stopped", code="engine_stopped"))
        failure = getattr(client.engine, "error", None)  # the last exception a step raised, if any
        return {
            "status": "ok",
            "in_flight": app.state.in_flight,
            "last_engine_error": None if failure is None else repr(failure),
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "llmlib",
                    "max_model_len": client.context_len,
                }
                for name in [model_name, *aliases]
            ],
        }

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > 16 * limits.max_prompt_chars + 65_536:
            raise APIError(
                413, f"the request body is {len(raw)} bytes; too large", code="body_too_large"
            )
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from e

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await read_json(request)
            req = parser.chat(body) if chat else parser.completion(body)
        except APIError as e:
            return error(e)
        if app.state.in_flight >= limits.max_queue:
            return error(
                APIError(
                    503,
                    f"the server is at capacity ({limits.max_queue} requests in flight); "
                    "retry later",
                    code="queue_full",
                    type_="server_overloaded",
                )
            )
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        app.state.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                app.state.in_flight -= 1

        try:
            if req.stream:
                # Pull the first event before answering, so an engine that refuses the request
                # (queue full) still gets a proper status code instead of a broken stream.
                events = client.stream(req.prompt_ids, req.params, rid).__aiter__()
                try:
                    first = await events.__anext__()
                except StopAsyncIteration:
                    first = Delta("", 0, "stop")
                body_iter = _sse(rid, model_name, req, first, events, release)

                async def on_close() -> None:
                    await _aclose(body_iter)  # runs _sse's finally if it started ...
                    await _aclose(events)  # ... and aborts the request even if it never did
                    release()

                return _SSEResponse(body_iter, on_close)
            return await _complete_watching(request, rid, model_name, req, client, release)
        except QueueFullError as e:
            release()
            return error(
                APIError(
                    503,
                    f"the engine's queue is full: {e}",
                    code="queue_full",
                    type_="server_overloaded",
                )
            )
        except APIError as e:
            release()
            return error(e)
        except Exception:
            release()
            raise
        finally:
            if not req.stream:
                release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


def _sse_response_class() -> Any:
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        """A streaming response that always cleans up: whether the stream ends, the client leaves
        before the first byte, or the task is cancelled, ``on_close`` runs."""

        def __init__(self, content: Any, on_close: Any):
            super().__init__(
                content,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            self._on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self._on_close()

    return SSEResponse


def _SSEResponse(content: Any, on_close: Any) -> Any:
    global _SSE_CLASS
    if _SSE_CLASS is None:
        _SSE_CLASS = _sse_response_class()
    return _SSE_CLASS(content, on_close)


_SSE_CLASS: Any = None


def _usage(req: ParsedRequest, n: int) -> dict[str, int]:
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": n,
        "total_tokens": len(req.prompt_ids) + n,
    }


def _chunk(
    rid: str,
    model: str,
    req: ParsedRequest,
    text: str | None,
    reason: str | None,
    first: bool = False,
) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": model}
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}],
    }


async def _sse(
    rid: str,
    model: str,
    req: ParsedRequest,
    first: Delta,
    events: AsyncIterator[Delta],
    release: Any,
) -> AsyncIterator[bytes]:
    """The server-sent event stream. If the client disconnects, Starlette cancels this generator (or
    the next write fails); either way ``finally`` closes the engine stream, which aborts the request."""

    def line(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    n = 0
    try:
        if req.chat:
            yield line(_chunk(rid, model, req, "", None, first=True))
        d: Delta | None = first
        while d is not None:
            n += d.n_tokens
            if d.text or d.finish_reason is None:
                yield line(_chunk(rid, model, req, d.text, None))
            if d.finish_reason is not None:
                reason = "stop" if d.finish_reason == "abort" else d.finish_reason
                yield line(_chunk(rid, model, req, None if req.chat else "", reason))
                break
            try:
                d = await events.__anext__()
            except StopAsyncIteration:
                yield line(_chunk(rid, model, req, None if req.chat else "", "stop"))
                break
        if req.include_usage:
            yield line(
                {
                    "id": rid,
                    "object": "chat.completion.chunk" if req.chat else "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [],
                    "usage": _usage(req, n),
                }
            )
        yield b"data: [DONE]\n\n"
    except Exception as e:
        yield line(APIError(500, f"generation failed: {type(e).__name__}: {e}").body())
        yield b"data: [DONE]\n\n"
    finally:
        await _aclose(events)
        release()


async def _complete_watching(
    request: Any, rid: str, model: str, req: ParsedRequest, client: EngineClient, release: Any
) -> Any:
    """Run a non-streaming request to the end, but abort it if the client hangs up meanwhile."""

    async def collect() -> tuple[str, int, str]:
        parts, n, reason = [], 0, "stop"
        events = client.stream(req.prompt_ids, req.params, rid)
        try:
            async for d in events:
                parts.append(d.text)
                n += d.n_tokens
                if d.finish_reason is not None:
                    reason = d.finish_reason
                    break
        finally:
            await _aclose(events)
        return "".join(parts), n, reason

    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work not in done:
        work.cancel()  # the client left: closing the stream aborts the request and frees its blocks
        try:
            await work
        except (asyncio.CancelledError, Exception):
            pass
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    text, n, reason = work.result()
    if reason == "abort":
        reason = "stop"
    body: dict[str, Any] = {
        "id": rid,
        "created": int(time.time()),
        "model": model,
        "usage": _usage(req, n),
    }
    if req.chat:
        body.update(
            object="chat.completion",
            choices=[
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
            ],
        )
    else:
        body.update(
            object="text_completion",
            choices=[{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
        )
    return JSONResponse(body)
