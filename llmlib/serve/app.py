"""An OpenAI-compatible HTTP server on the batching engine (``llmlib serve``).

Every request becomes one sequence per choice in the engine of chapter 10; the engine's loop
batches all of them into shared forward passes, and this module only translates: JSON in,
validated against the pydantic models of :mod:`llmlib.serve.protocol`, turned into token ids and
:class:`~llmlib.sampling.SamplingParams` by :mod:`llmlib.serve.prepare`, tokens back out as one
JSON body or as server-sent events (``data: {...}`` lines, then ``data: [DONE]``), the wire format
the ``openai`` client speaks (:mod:`llmlib.serve.render`).

What a public endpoint has to get right, beyond the happy path:

* it binds to 127.0.0.1 unless told otherwise: a model server is not something to expose by accident;
* every request is bounded (prompt characters and tokens, ``max_tokens`` against what the context
  has left, choices, stop strings, log-probabilities, logit biases, the body's size); a bad request
  gets a 4xx with an OpenAI-style error body naming the field, a body nested too deep to parse a
  400, and nothing from a request is ever evaluated;
* when the engine's queue is full it says 503 at once instead of queueing without limit;
* a client that goes away mid-stream has its request aborted, so its KV blocks return to the pool.

Besides ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` it serves what clients
probe: ``/health``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import llmlib.serve.prepare as prepare
from llmlib.engine import AsyncLLM, RequestOutput
from llmlib.serve.client import EngineClient, aclose, merged
from llmlib.serve.metrics import CONTENT_TYPE, ServerMetrics
from llmlib.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    bad,
    error_from_validation,
)
from llmlib.serve.render import ChunkWriter, completion_body

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def create_app(
    engine: AsyncLLM,
    model_name: str,
    *,
    limits: Limits | None = None,
    aliases: tuple[str, ...] = (),
) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model id ``model_name`` (and ``aliases``).

    Tests build the app around a small random-weight model; ``llmlib serve`` around SmolLM2. The
    one bound on requests in flight is the engine's ``max_queue``.
    """
    client = EngineClient(engine)
    limits = limits or Limits()
    served = {model_name, *aliases}
    metrics = ServerMetrics(engine, model_name)
    app = FastAPI(
        title="llmlib", description="An OpenAI-compatible server on llmlib's batching engine"
    )
    app.state.client, app.state.limits, app.state.metrics = client, limits, metrics
    created = int(time.time())

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(error_from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:  # never a bare traceback
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Any:
        thread = engine._thread  # the stepping thread, once started
        if thread is not None and not thread.is_alive():
            return error(APIError(503, "the engine's thread has stopped", code="engine_stopped"))
        failure = engine.error  # the last exception a step raised, if any
        return {
            "status": "ok",
            "in_flight": engine.num_in_flight,
            "last_engine_error": None if failure is None else repr(failure),
            "engine": engine.llm.engine_config.as_dict(),
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

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        prepare.check_model(body.model, served, required=False)
        if (body.prompt is None) == (body.messages is None):
            raise bad("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            text = prepare.chat_prompt(client, limits, body.messages, body.add_generation_prompt)
            ids = client.encode(text, allow_special=True)
        else:
            if len(body.prompt) > limits.max_prompt_chars:
                raise bad("'prompt' is too long", "prompt", "prompt_too_long")
            ids = (client.bos() if body.add_special_tokens else []) + client.encode(
                body.prompt, allow_special=True
            )
        strs = [client.token_str(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": client.context_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        prepare.check_model(body.model, served, required=False)
        if any(not 0 <= t < client.vocab_size for t in body.tokens):
            raise bad(f"'tokens' must lie in 0..{client.vocab_size - 1}", "tokens")
        return {"prompt": client.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prepare.check_model(body.model, served)
        return await run(request, prepare.completion(client, limits, body), "cmpl-")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        prepare.check_model(body.model, served)
        return await run(request, prepare.chat(client, limits, body), "chatcmpl-")

    async def run(request: Request, prep: prepare.Prepared, prefix: str) -> Any:
        rid = prefix + uuid.uuid4().hex[:24]
        streams = []
        try:
            for i, ids in enumerate(prep.prompts):
                streams.append(client.submit(ids, prep.params, f"{rid}-{i}"))
        except APIError:
            for s in streams:
                s.abort()
            raise
        events = merged(streams)
        t0 = time.perf_counter()
        if prep.stream:
            body = _sse(ChunkWriter(client, rid, model_name, prep), prep, events, metrics, t0)
            return _SSEResponse(body, events, streams)
        try:
            return await _complete_watching(
                request, rid, model_name, prep, client, events, metrics, t0
            )
        finally:
            for s in streams:
                s.abort()

    return app


class _TooLarge(Exception):
    pass


class _BodyLimit:
    """Refuse a body over ``limit`` bytes: at once from its Content-Length (413), or while it
    streams in without one (the read fails, and FastAPI answers 400)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = dict(scope.get("headers") or []).get(b"content-length", b"")
        if size.isdigit() and int(size) > self.limit:
            e = APIError(
                413, f"the request body is {int(size)} bytes; too large", code="body_too_large"
            )
            return await JSONResponse(e.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b"")) if msg["type"] == "http.request" else 0
            if seen > self.limit:
                while msg["type"] == "http.request" and msg.get("more_body", False):
                    msg = await receive()  # dropped unread, so the client gets its answer
                raise _TooLarge(f"the request body is over {self.limit} bytes")
            return msg

        await self.app(scope, bounded, send)


def _line(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _sse(
    writer: ChunkWriter,
    prep: prepare.Prepared,
    events: AsyncIterator[tuple[int, RequestOutput]],
    metrics: ServerMetrics,
    t0: float,
) -> AsyncIterator[bytes]:
    """The server-sent event stream. If the client disconnects, Starlette cancels this generator
    (or the next write fails); either way ``finally`` closes the engine streams, which aborts them."""
    finished: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    states = [{"t0": t0} for _ in prep.prompts]
    try:
        for c in writer.first():
            yield _line(c)
        async for p, out in events:
            metrics.observe(out, time.perf_counter(), states[p])
            for c in writer.step(p, out, finished):
                yield _line(c)
            if out.finished:
                finals[p] = out
        if prep.include_usage:
            from llmlib.serve.render import usage

            done = [finals[p] for p in sorted(finals)]
            yield _line(writer.chunk([], usage=usage(prep, done)))
        yield b"data: [DONE]\n\n"
    except Exception as e:
        yield _line(APIError(500, f"generation failed: {type(e).__name__}: {e}").body())
        yield b"data: [DONE]\n\n"
    finally:
        await aclose(events)


def _SSEResponse(content: Any, events: Any, streams: list[Any]) -> Any:
    """A streaming response that always cleans up: whether the stream ends, the client leaves
    before the first byte, or the task is cancelled, the engine streams are closed."""
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await aclose(content)  # runs _sse's finally if it started ...
                await aclose(events)
                for s in streams:  # ... and abort the requests even if it never did
                    s.abort()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SSEResponse(content, media_type="text/event-stream", headers=headers)


async def _complete_watching(
    request: Request,
    rid: str,
    model: str,
    prep: prepare.Prepared,
    client: EngineClient,
    events: AsyncIterator[tuple[int, RequestOutput]],
    metrics: ServerMetrics,
    t0: float,
) -> Any:
    """Run a request that is not streamed to the end, but abort it if the client hangs up."""

    async def collect() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        states = [{"t0": t0} for _ in prep.prompts]
        try:
            async for p, out in events:
                metrics.observe(out, time.perf_counter(), states[p])
                if out.finished:
                    finals[p] = out
        finally:
            await aclose(events)
        return [finals[p] for p in range(len(prep.prompts))]

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
        work.cancel()  # the client left: closing the streams aborts the requests
        try:
            await work
        except (asyncio.CancelledError, Exception):
            pass
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    return JSONResponse(completion_body(client, rid, model, prep, work.result()))
