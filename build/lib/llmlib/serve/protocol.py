"""The request protocol: OpenAI-style JSON bodies checked and turned into engine requests.

Every bound on a request lives here (prompt characters, messages, stop strings, ``max_tokens``
against what the context leaves), and every refusal is an :class:`APIError` whose body names the
field, the shape OpenAI's clients expect: ``{"error": {"message", "type", "param", "code"}}``.
Nothing from a request is ever evaluated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmlib.prompts import CHATML, chat_text
from llmlib.sampling import SamplingParams

# ---- errors ---------------------------------------------------------------------------------------


class APIError(Exception):
    """An error that becomes an OpenAI-style JSON body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class QueueFullError(Exception):
    """Raised (by the engine or by the server's own admission count) when no more requests fit."""


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request validation ---------------------------------------------------------------------------


class PromptEncoder(Protocol):
    """What request parsing needs of the engine (:class:`llmlib.serve.client.EngineClient` is one)."""

    tokenizer: Any
    context_len: int

    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...


@dataclass
class Limits:
    """Bounds on what one request may ask for (all enforced before the engine sees it)."""

    max_prompt_chars: int = 32_000
    max_messages: int = 256
    max_stop: int = 4
    max_stop_chars: int = 256
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context)
    max_queue: int = 64  # requests in flight (running + waiting) before new ones get 503


def _field(
    body: dict, name: str, types: tuple[type, ...], default: Any = None, what: str = ""
) -> Any:
    if name not in body or body[name] is None:
        return default
    v = body[name]
    # bool is an int in Python; a JSON true for max_tokens is still the wrong type
    if isinstance(v, bool) and bool not in types:
        raise _bad(f"'{name}' must be {what or _names(types)}, got a boolean", name, "invalid_type")
    if not isinstance(v, types):
        raise _bad(
            f"'{name}' must be {what or _names(types)}, got {_json_type(v)}", name, "invalid_type"
        )
    return v


def _names(types: tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(names.get(t, t.__name__) for t in types)


def _json_type(v: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(v), type(v).__name__)


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

    def __init__(self, client: PromptEncoder, model_names: set[str], limits: Limits):
        self.client, self.model_names, self.limits = client, model_names, limits

    def common(self, body: Any, chat: bool) -> tuple[dict, bool, bool]:
        if not isinstance(body, dict):
            raise _bad(
                f"the request body must be a JSON object, got {_json_type(body)}",
                None,
                "invalid_type",
            )
        model = _field(body, "model", (str,))
        if model is None:
            raise _bad("'model' is required", "model", "missing_field")
        if model not in self.model_names:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves "
                f"{', '.join(sorted(self.model_names))}",
                "model",
                "model_not_found",
            )
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
                raise _bad(
                    f"'{name}' is not supported (use 'repetition_penalty'); it must be 0 or absent",
                    name,
                    "unsupported",
                )
        stream = _field(body, "stream", (bool,), False)
        opts = _field(body, "stream_options", (dict,), {})
        include_usage = bool(_field(opts, "include_usage", (bool,), False)) if opts else False
        return body, stream, include_usage

    def sampling(self, body: dict, prompt_len: int, chat: bool) -> SamplingParams:
        ctx = self.client.context_len
        room = ctx - prompt_len
        if room < 1:
            raise _bad(
                f"the prompt is {prompt_len} tokens, which leaves no room in this model's context of "
                f"{ctx} tokens",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        key = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
        max_tokens = _field(body, key, (int,), None)
        if max_tokens is None:
            max_tokens = min(room, self.limits.default_max_tokens) if chat else min(room, 16)
        if max_tokens < 1:
            raise _bad(f"'{key}' must be at least 1, got {max_tokens}", key)
        if max_tokens > room:
            raise _bad(
                f"'{key}' is {max_tokens}, but the prompt ({prompt_len} tokens) leaves only {room} of this "
                f"model's context of {ctx} tokens",
                key,
                "context_length_exceeded",
            )
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
        if len(stop) > self.limits.max_stop or any(
            len(s) > self.limits.max_stop_chars for s in stop
        ):
            raise _bad(
                f"'stop' takes at most {self.limits.max_stop} strings of at most "
                f"{self.limits.max_stop_chars} characters",
                "stop",
            )
        if any(s == "" for s in stop):
            raise _bad("'stop' strings must not be empty", "stop")
        ignore_eos = _field(body, "ignore_eos", (bool,), False)
        try:
            return SamplingParams(
                temperature=float(temperature),
                top_k=None if top_k in (None, -1) else top_k,
                top_p=None if top_p == 1.0 else float(top_p),
                min_p=None if min_p == 0 else float(min_p),
                repetition_penalty=float(rep),
                seed=seed,
                max_tokens=max_tokens,
                stop=stop,
                ignore_eos=ignore_eos,
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
                raise _bad(
                    f"'prompt' has {len(prompt)} characters; the limit is {self.limits.max_prompt_chars}",
                    "prompt",
                    "prompt_too_long",
                )
            ids = self._encode(prompt, "prompt")
            bos = getattr(self.client.tokenizer, "bos_id", None)
            if getattr(self.client.tokenizer, "add_bos", False) and bos is not None:
                ids = [bos] + ids
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = getattr(self.client.tokenizer, "vocab_size", None)
            if vocab is not None and any(not 0 <= t < vocab for t in prompt):
                raise _bad(f"'prompt' token ids must lie in 0..{vocab - 1}", "prompt")
            ids = list(prompt)
        elif prompt is None:
            raise _bad("'prompt' is required", "prompt", "missing_field")
        else:
            raise _bad(
                "'prompt' must be a string, a one-element array of strings, or an array of token ids "
                "(one prompt per request)",
                "prompt",
                "invalid_type",
            )
        if len(ids) >= self.client.context_len:
            raise _bad(
                f"the prompt is {len(ids)} tokens; this model's context is {self.client.context_len} "
                f"tokens",
                "prompt",
                "context_length_exceeded",
            )
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
            raise _bad(
                f"'messages' has {len(messages)} entries; the limit is {self.limits.max_messages}",
                "messages",
            )
        clean, chars = [], 0
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"'{where}' must be an object", where, "invalid_type")
            role = m.get("role")
            if role not in ("system", "user", "assistant", "developer"):
                raise _bad(
                    f"'{where}.role' must be system, user or assistant, got {role!r}",
                    where + ".role",
                )
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for part in content:
                    if not (
                        isinstance(part, dict)
                        and part.get("type") == "text"
                        and isinstance(part.get("text"), str)
                    ):
                        raise _bad(
                            f"'{where}.content' parts must be text parts",
                            where + ".content",
                            "invalid_type",
                        )
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise _bad(
                    f"'{where}.content' must be a string", where + ".content", "invalid_type"
                )
            # A chat message must not smuggle in the template's control tokens.
            self._encode(content, where + ".content")
            chars += len(content)
            clean.append({"role": "system" if role == "developer" else role, "content": content})
        if chars > self.limits.max_prompt_chars:
            raise _bad(
                f"'messages' hold {chars} characters; the limit is {self.limits.max_prompt_chars}",
                "messages",
                "prompt_too_long",
            )
        text = render_chat(self.client.tokenizer, clean)
        ids = self._encode(text, "messages", allow_special=True)
        if len(ids) >= self.client.context_len:
            raise _bad(
                f"the conversation is {len(ids)} tokens; this model's context is {self.client.context_len} "
                f"tokens",
                "messages",
                "context_length_exceeded",
            )
        params = self.sampling(body, len(ids), chat=True)
        return ParsedRequest(ids, params, stream, include_usage, chat=True)


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Render ``messages`` with the model's own chat template (ChatML when it has none)."""
    from jinja2.exceptions import TemplateError

    try:
        return chat_text(tokenizer, messages, fallback=CHATML)
    except TemplateError as e:
        raise _bad(f"the chat template rejected these messages: {e}", "messages") from e


def _number(
    body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = _field(body, name, (int, float), default, what="a number")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(f"'{name}' must be in {left}{lo}, {hi}], got {v}", name)
    return float(v)
