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

import argparse
import asyncio
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlib.sampling import SamplingParams

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


# ---- errors ---------------------------------------------------------------------------------------

class APIError(Exception):
    """An error that becomes an OpenAI-style JSON body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class QueueFullError(Exception):
    """Raised (by the engine or by the server's own admission count) when no more requests fit."""


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- the engine as the server sees it ------------------------------------------------------------

@dataclass
class Delta:
    """What one engine step produced for one request: new text, new token count, and why it ended."""

    text: str
    n_tokens: int
    finish_reason: str | None = None


class EngineClient:
    """The server's view of the engine: tokenizer, context length, and an async stream per request.

    It adapts :class:`llmlib.engine.AsyncLLM` (or anything with the same ``stream``/``abort``) and
    normalises what the engine yields into :class:`Delta`\\ s. Subclass it to serve something else
    (the tests do, to hold a request open).
    """

    def __init__(self, engine: Any, tokenizer: Any = None, context_len: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else _find(engine, "tokenizer", "tok")
        if self.tokenizer is None:
            raise ValueError("EngineClient: the engine exposes no tokenizer; pass tokenizer=")
        if context_len is None:
            context_len = _find(engine, "max_model_len", "context_len", "max_seq_len")
            if context_len is None:
                model = _find(engine, "model")
                context_len = getattr(getattr(model, "config", None), "max_seq_len", None)
        if not isinstance(context_len, int) or context_len < 2:
            raise ValueError(f"EngineClient: cannot tell the context length (got {context_len!r}); pass context_len=")
        self.context_len = context_len

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if allow_special:
            return list(self.tokenizer.encode(text, allowed_special="all"))
        return list(self.tokenizer.encode(text))

    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Delta]:
        """Yield :class:`Delta`\\ s until the request finishes. Closing the iterator aborts the request."""
        sent_text, sent_tokens = "", 0
        agen = self.engine.stream(prompt_ids, params, request_id=request_id)
        try:
            while True:
                try:
                    out = await agen.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as e:
                    if type(e).__name__ == "QueueFull":  # llmlib.engine.QueueFull, at submission
                        raise QueueFullError(str(e)) from e
                    if isinstance(e, (ValueError, TypeError)) and sent_tokens == 0:
                        raise _bad(f"the engine refused the request: {e}") from e
                    raise
                if hasattr(out, "delta_token_ids"):  # llmlib.engine.RequestOutput carries the step's delta
                    delta_text, delta_n = out.delta_text, len(out.delta_token_ids)
                    reason = out.finish_reason
                else:  # anything reporting cumulative text and ids
                    text, n, reason = _read_output(out)
                    delta_text, delta_n = text[len(sent_text):], n - sent_tokens
                    sent_text = text
                sent_tokens += delta_n
                yield Delta(delta_text, delta_n, _finish_reason(reason))
                if reason is not None:
                    return
        finally:
            await _aclose(agen)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        abort = getattr(self.engine, "abort", None)
        if abort is not None:
            try:
                abort(request_id)
            except (KeyError, ValueError):
                pass  # already finished: nothing to free


def _find(obj: Any, *names: str) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    inner = getattr(obj, "llm", None) or getattr(obj, "engine", None)
    if inner is not None and inner is not obj:
        for n in names:
            v = getattr(inner, n, None)
            if v is not None:
                return v
    return None


def _read_output(out: Any) -> tuple[str, int, str | None]:
    if isinstance(out, Delta):
        return out.text, out.n_tokens, out.finish_reason
    text = getattr(out, "text", "")
    ids = getattr(out, "token_ids", None)
    n = len(ids) if ids is not None else int(getattr(out, "n_tokens", 0))
    reason = getattr(out, "finish_reason", None)
    return text or "", n, reason


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}.get(str(reason), str(reason))


async def _aclose(agen: Any) -> None:
    close = getattr(agen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - closing must never mask the real outcome
            pass


# ---- request validation ---------------------------------------------------------------------------

@dataclass
class Limits:
    """Bounds on what one request may ask for (all enforced before the engine sees it)."""

    max_prompt_chars: int = 32_000
    max_messages: int = 256
    max_stop: int = 4
    max_stop_chars: int = 256
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context)
    max_queue: int = 64  # requests in flight (running + waiting) before new ones get 503


def _field(body: dict, name: str, types: tuple[type, ...], default: Any = None, what: str = "") -> Any:
    if name not in body or body[name] is None:
        return default
    v = body[name]
    # bool is an int in Python; a JSON true for max_tokens is still the wrong type
    if isinstance(v, bool) and bool not in types:
        raise _bad(f"'{name}' must be {what or _names(types)}, got a boolean", name, "invalid_type")
    if not isinstance(v, types):
        raise _bad(f"'{name}' must be {what or _names(types)}, got {_json_type(v)}", name, "invalid_type")
    return v


def _names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _json_type(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    extra: dict = field(default_factory=dict)


class RequestParser:
    """Turns a decoded JSON body into prompt ids and :class:`SamplingParams`, or raises :class:`APIError`."""

    def __init__(self, client: EngineClient, model_names: set[str], limits: Limits):
        self.client, self.model_names, self.limits = client, model_names, limits

    def common(self, body: Any, chat: bool) -> tuple[dict, bool, bool]:
        if not isinstance(body, dict):
            raise _bad(f"the request body must be a JSON object, got {_json_type(body)}", None, "invalid_type")
        model = _field(body, "model", (str,))
        if model is None:
            raise _bad("'model' is required", "model", "missing_field")
        if model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{', '.join(sorted(self.model_names))}", "model", "model_not_found")
        n = _field(body, "n", (int,), 1)
        if n != 1:
            raise _bad(f"'n' must be 1 (this server returns one choice per request), got {n}", "n")
        best_of = _field(body, "best_of", (int,), 1)
        if best_of != 1:
            raise _bad(f"'best_of' must be 1, got {best_of}", "best_of")
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
            v = body.get(name)
            if v not in (None, False, 0, {}, []) and not (name == "logprobs" and v is False):
                raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _field(body, name, (int, float), 0.0)
            if v != 0:
                raise _bad(f"'{name}' is not supported (use 'repetition_penalty'); it must be 0 or absent",
                           name, "unsupported")
        stream = _field(body, "stream", (bool,), False)
        opts = _field(body, "stream_options", (dict,), {})
        include_usage = bool(_field(opts, "include_usage", (bool,), False)) if opts else False
        return body, stream, include_usage

    def sampling(self, body: dict, prompt_len: int, chat: bool) -> SamplingParams:
        ctx = self.client.context_len
        room = ctx - prompt_len
        if room < 1:
            raise _bad(f"the prompt is {prompt_len} tokens, which leaves no room in this model's context of "
                       f"{ctx} tokens", "messages" if chat else "prompt", "context_length_exceeded")
        key = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
        max_tokens = _field(body, key, (int,), None)
        if max_tokens is None:
            max_tokens = min(room, self.limits.default_max_tokens) if chat else min(room, 16)
        if max_tokens < 1:
            raise _bad(f"'{key}' must be at least 1, got {max_tokens}", key)
        if max_tokens > room:
            raise _bad(f"'{key}' is {max_tokens}, but the prompt ({prompt_len} tokens) leaves only {room} of this "
                       f"model's context of {ctx} tokens", key, "context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, lo=0.0, hi=2.0)
        top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
        min_p = _number(body, "min_p", 0.0, lo=0.0, hi=1.0)
        rep = _number(body, "repetition_penalty", 1.0, lo=0.0, hi=10.0, lo_open=True)
        top_k = _field(body, "top_k", (int,), None)
        if top_k is not None and top_k != -1 and top_k < 1:
            raise _bad(f"'top_k' must be -1 (off) or at least 1, got {top_k}", "top_k")
        seed = _field(body, "seed", (int,), None)
        if seed is not None and not 0 <= seed < 2**63:
            raise _bad(f"'seed' must be a non-negative integer below 2**63, got {seed}", "seed")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
        if len(stop) > self.limits.max_stop or any(len(s) > self.limits.max_stop_chars for s in stop):
            raise _bad(f"'stop' takes at most {self.limits.max_stop} strings of at most "
                       f"{self.limits.max_stop_chars} characters", "stop")
        if any(s == "" for s in stop):
            raise _bad("'stop' strings must not be empty", "stop")
        ignore_eos = _field(body, "ignore_eos", (bool,), False)
        try:
            return SamplingParams(
                temperature=float(temperature), top_k=None if top_k in (None, -1) else top_k,
                top_p=None if top_p == 1.0 else float(top_p), min_p=None if min_p == 0 else float(min_p),
                repetition_penalty=float(rep), seed=seed, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
            )
        except (TypeError, ValueError) as e:  # the engine's own validation, as a second line
            raise _bad(str(e)) from e

    def _encode(self, text: str, param: str, allow_special: bool = False) -> list[int]:
        try:
            return self.client.encode(text, allow_special=allow_special)
        except ValueError as e:  # e.g. a special token typed into the text
            raise _bad(f"'{param}' cannot be tokenized: {e}", param) from e

    def completion(self, body: Any) -> ParsedRequest:
        body, stream, include_usage = self.common(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the openai client may wrap a single prompt in a list
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("'prompt' must not be empty", "prompt")
            if len(prompt) > self.limits.max_prompt_chars:
                raise _bad(f"'prompt' has {len(prompt)} characters; the limit is {self.limits.max_prompt_chars}",
                           "prompt", "prompt_too_long")
            ids = self._encode(prompt, "prompt")
            bos = getattr(self.client.tokenizer, "bos_id", None)
            if getattr(self.client.tokenizer, "add_bos", False) and bos is not None:
                ids = [bos] + ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = getattr(self.client.tokenizer, "vocab_size", None)
            if vocab is not None and any(not 0 <= t < vocab for t in prompt):
                raise _bad(f"'prompt' token ids must lie in 0..{vocab - 1}", "prompt")
            ids = list(prompt)
        elif prompt is None:
            raise _bad("'prompt' is required", "prompt", "missing_field")
        else:
            raise _bad("'prompt' must be a string, a one-element array of strings, or an array of token ids "
                       "(one prompt per request)", "prompt", "invalid_type")
        if len(ids) >= self.client.context_len:
            raise _bad(f"the prompt is {len(ids)} tokens; this model's context is {self.client.context_len} "
                       f"tokens", "prompt", "context_length_exceeded")
        params = self.sampling(body, len(ids), chat=False)
        return ParsedRequest(ids, params, stream, include_usage, chat=False)

    def chat(self, body: Any) -> ParsedRequest:
        body, stream, include_usage = self.common(body, chat=True)
        messages = body.get("messages")
        if messages is None:
            raise _bad("'messages' is required", "messages", "missing_field")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty array", "messages", "invalid_type")
        if len(messages) > self.limits.max_messages:
            raise _bad(f"'messages' has {len(messages)} entries; the limit is {self.limits.max_messages}", "messages")
        clean, chars = [], 0
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"'{where}' must be an object", where, "invalid_type")
            role = m.get("role")
            if role not in ("system", "user", "assistant", "developer"):
                raise _bad(f"'{where}.role' must be system, user or assistant, got {role!r}", where + ".role")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise _bad(f"'{where}.content' parts must be text parts", where + ".content", "invalid_type")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise _bad(f"'{where}.content' must be a string", where + ".content", "invalid_type")
            # A chat message must not smuggle in the template's control tokens.
            self._encode(content, where + ".content")
            chars += len(content)
            clean.append({"role": "system" if role == "developer" else role, "content": content})
        if chars > self.limits.max_prompt_chars:
            raise _bad(f"'messages' hold {chars} characters; the limit is {self.limits.max_prompt_chars}",
                       "messages", "prompt_too_long")
        text = render_chat(self.client.tokenizer, clean)
        ids = self._encode(text, "messages", allow_special=True)
        if len(ids) >= self.client.context_len:
            raise _bad(f"the conversation is {len(ids)} tokens; this model's context is {self.client.context_len} "
                       f"tokens", "messages", "context_length_exceeded")
        params = self.sampling(body, len(ids), chat=True)
        return ParsedRequest(ids, params, stream, include_usage, chat=True)


# ChatML, SmolLM2's format, for tokenizers that carry no template of their own.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Render ``messages`` with the model's own chat template (chapter 7's sandboxed Jinja renderer)."""
    from jinja2.exceptions import TemplateError

    from llmlib.generate import render_chat as render

    template = getattr(tokenizer, "chat_template", None) or CHATML
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    inv = {v: k for k, v in specials.items()}
    bos = inv.get(getattr(tokenizer, "bos_id", None), "")
    eos = inv.get(getattr(tokenizer, "eos_id", None), "")
    try:
        return render(template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except TemplateError as e:
        raise _bad(f"the chat template rejected these messages: {e}", "messages") from e


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _field(body, name, (int, float), default, what="a number")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(f"'{name}' must be in {left}{lo}, {hi}], got {v}", name)
    return float(v)


# ---- the app --------------------------------------------------------------------------------------

def create_app(engine: Any, model_name: str, *, tokenizer: Any = None, context_len: int | None = None,
               limits: Limits | None = None, max_queue: int | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A FastAPI app serving ``engine`` under the model id ``model_name``.

    ``engine`` is an :class:`llmlib.engine.AsyncLLM` (or an :class:`EngineClient`). Tests build the app
    around a small random-weight model; ``llmlib serve`` around SmolLM2.
    """

    client = engine if isinstance(engine, EngineClient) else EngineClient(engine, tokenizer, context_len)
    limits = limits or Limits()
    if max_queue is not None:
        limits.max_queue = max_queue
    parser = RequestParser(client, {model_name, *aliases}, limits)
    app = FastAPI(title="llmlib", description="An OpenAI-compatible server on llmlib's batching engine")
    app.state.client, app.state.limits = client, limits
    app.state.in_flight = 0
    created = int(time.time())

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:  # never a bare traceback
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Any:
        thread = getattr(client.engine, "_thread", None)  # AsyncLLM's stepping thread, once started
        if thread is not None and not thread.is_alive():
            return error(APIError(503, "the engine's thread has stopped", code="engine_stopped"))
        failure = getattr(client.engine, "error", None)  # the last exception a step raised, if any
        return {"status": "ok", "in_flight": app.state.in_flight,
                "last_engine_error": None if failure is None else repr(failure)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "llmlib",
             "max_model_len": client.context_len} for name in [model_name, *aliases]]}

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > 16 * limits.max_prompt_chars + 65_536:
            raise APIError(413, f"the request body is {len(raw)} bytes; too large", code="body_too_large")
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
            return error(APIError(503, f"the server is at capacity ({limits.max_queue} requests in flight); "
                                       "retry later", code="queue_full", type_="server_overloaded"))
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
            return error(APIError(503, f"the engine's queue is full: {e}", code="queue_full", type_="server_overloaded"))
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
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n, "total_tokens": len(req.prompt_ids) + n}


def _chunk(rid: str, model: str, req: ParsedRequest, text: str | None, reason: str | None, first: bool = False) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": model}
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    return {**base, "object": "text_completion",
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}


async def _sse(rid: str, model: str, req: ParsedRequest, first: Delta, events: AsyncIterator[Delta],
               release: Any) -> AsyncIterator[bytes]:
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
            yield line({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                        "created": int(time.time()), "model": model, "choices": [], "usage": _usage(req, n)})
        yield b"data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - report in-band: the status line has already gone out
        yield line(APIError(500, f"generation failed: {type(e).__name__}: {e}").body())
        yield b"data: [DONE]\n\n"
    finally:
        await _aclose(events)
        release()


async def _complete_watching(request: Any, rid: str, model: str, req: ParsedRequest, client: EngineClient,
                             release: Any) -> Any:
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
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    text, n, reason = work.result()
    if reason == "abort":
        reason = "stop"
    body: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model, "usage": _usage(req, n)}
    if req.chat:
        body.update(object="chat.completion", choices=[{"index": 0, "message": {"role": "assistant", "content": text},
                                                         "logprobs": None, "finish_reason": reason}])
    else:
        body.update(object="text_completion", choices=[{"index": 0, "text": text, "logprobs": None,
                                                         "finish_reason": reason}])
    return JSONResponse(body)


# ---- running it -----------------------------------------------------------------------------------

class ServerThread:
    """Run an app under uvicorn in a background thread on 127.0.0.1 (port 0 = any free port).

    ``with ServerThread(app) as s: ... s.url ...``; used by the tests, the notebook and the benchmark.
    """

    def __init__(self, app: Any, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                     timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="llmlib-server", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting (port in use?)")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_engine(model: str | None = None, device: str | None = None, dtype: str | None = None, **engine_kwargs: Any):
    """Load a model into the async batching engine: ``(engine, model_id)``."""
    from pathlib import Path

    from llmlib.device import choose
    from llmlib.fetch import resolve_model_path

    path = resolve_model_path(model)
    place = choose(device, dtype)
    engine = _make_async_engine(path, place.device, place.dtype, **engine_kwargs)
    return engine, Path(path).stem if Path(path).is_file() else Path(path).name


def _make_async_engine(path: Any, device: Any, dtype: Any, **kw: Any) -> Any:
    from llmlib.engine import AsyncLLM

    return AsyncLLM(str(path), device=device, dtype=dtype, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib serve", description="An OpenAI-compatible server on llmlib's batching engine.")
    ap.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2, fetched)")
    ap.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--max-queue", type=int, default=64, help="requests in flight before new ones get 503")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients must send (default: file name)")
    ap.add_argument("--max-prompt-chars", type=int, default=Limits.max_prompt_chars)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy, shared CPU)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    if args.max_queue < 1:
        ap.error("--max-queue must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"llmlib serve: warning: binding {args.host}; anyone who can reach it can use this model",
              flush=True)
    import uvicorn

    engine, name = build_engine(args.model, args.device, args.dtype)
    name = args.served_model_name or name
    app = create_app(engine, name, limits=Limits(max_prompt_chars=args.max_prompt_chars, max_queue=args.max_queue))
    print(f"llmlib serve: {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
