"""The engine as the server sees it: a tokenizer, a context length, and an async stream per request.

:class:`EngineClient` adapts :class:`llmlib.engine.AsyncLLM` (or anything with the same
``stream``/``abort``) and normalises what it yields into :class:`Delta`\\ s; closing a stream
aborts its request, so a client that leaves frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from llmlib.sampling import SamplingParams
from llmlib.serve.protocol import QueueFullError, _bad

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
            raise ValueError(
                f"EngineClient: cannot tell the context length (got {context_len!r}); pass context_len="
            )
        self.context_len = context_len

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if allow_special:
            return list(self.tokenizer.encode(text, allowed_special="all"))
        return list(self.tokenizer.encode(text))

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[Delta]:
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
                if hasattr(
                    out, "delta_token_ids"
                ):  # llmlib.engine.RequestOutput carries the step's delta
                    delta_text, delta_n = out.delta_text, len(out.delta_token_ids)
                    reason = out.finish_reason
                else:  # anything reporting cumulative text and ids
                    text, n, reason = _read_output(out)
                    delta_text, delta_n = text[len(sent_text) :], n - sent_tokens
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
    return {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}.get(
        str(reason), str(reason)
    )


async def _aclose(agen: Any) -> None:
    close = getattr(agen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            pass
