"""The request protocol: OpenAI's request bodies as pydantic models, and the errors they produce.

FastAPI validates every body against these models before a handler runs, and publishes them in
the OpenAPI document (``/openapi.json``, browsable at ``/docs``), so every field, its type and its
bound is written down once. Validation is strict: a string is not a number, ``true`` is not an
integer. A body that fails gets an :class:`APIError` whose JSON is the shape OpenAI's clients
expect, ``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the field
(``messages[0].role``). Bounds that depend on the server's settings or the model (prompt
characters, the context length, how many stop strings) are checked by :mod:`llmlib.serve.prepare`
with the same kind of error. Nothing from a request is ever evaluated.

The fields follow OpenAI's API, plus vLLM's extensions that its clients send (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``); fields this server does not implement (``suffix``, tools) are
refused by name rather than ignored, and unknown ones are ignored, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmlib.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

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


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 naming the field."""
    return APIError(400, message, param=param, code=code)


# pydantic names the member of a union that failed in an error's location ("str", "list[int]",
# "function-after[...]"); the field a client sent is what comes before it.
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def error_from_validation(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a body that failed validation: the first error, with the field it names."""
    if not errors:
        return bad("the request body is not valid", None)
    e = errors[0]
    if e.get("type") == "json_invalid":
        return bad(f"the request body is not valid JSON: {e.get('msg', '')}", None, "invalid_json")
    loc = list(e.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _TAGS or "[" in part or "-" in part:
            break
        else:
            param += ("." if param else "") + part
    kind = e.get("type", "")
    if kind == "missing":
        code = "missing_field"
    elif kind.endswith("_type") or kind in ("model_attributes_type", "dict_type", "list_type"):
        code = "invalid_type"
    else:
        code = "invalid_value"
    if not param:
        return bad(f"the request body must be a JSON object: {e.get('msg', '')}", None, code)
    return bad(f"'{param}': {e.get('msg', 'invalid')}", param, code)


# ---- the models -----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk with the request's usage")
    continuous_usage_stats: bool = Field(False, description="accepted; usage comes at the end")


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Strict):
    """The fields completions and chat completions share."""

    model: str = Field(description="the served model's id (GET /v1/models)", max_length=256)
    n: int = Field(1, ge=1, description="choices per prompt (bounded by the server's --max-n)")
    best_of: int | None = Field(None, ge=1, description="must equal n if given")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or absent = off; 0 is invalid")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's; 1 = off")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (as a string key) -> bias in [-100, 100]",
    )
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int | None = Field(None, ge=0, description="new tokens; 0 only with echo")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no EOS or stop before this many")
    stop: str | list[str] | None = Field(None, description="up to --max-stop strings")
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. A text prompt may contain special tokens written as text
    (``<|im_end|>``); they are parsed as those tokens, as vLLM and llama.cpp do."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, token ids, or a list of either (one set of choices per prompt)"
    )
    echo: bool = Field(False, description="return the prompt before the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top log-probs per token")
    suffix: str | None = Field(None, description="not supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] = Field(description="a string or text parts")
    name: str | None = Field(None, max_length=256)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. Message content is text: special tokens written in it are
    refused, so a user's message cannot forge the chat template's control tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = Field(False, description="log-probabilities of the output tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = Field(None, description="not supported")
    tool_choice: Any = Field(None, description="not supported")
    functions: list[Any] | None = Field(None, description="not supported")
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a prompt, or messages rendered with the chat template."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="the BOS a raw prompt gets, if any")
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = Field(None, max_length=256)
    tokens: list[int] = Field(description="token ids")


# ---- the server's own bounds -------------------------------------------------------------------------


@dataclass
class Limits:
    """Bounds on what one request may ask for, set per server (all checked before the engine sees it).

    The one bound on requests in flight is the engine's (``AsyncLLM(max_queue=...)``, set by
    ``llmlib serve --max-queue``): a request past it gets a 503.
    """

    max_prompt_chars: int = 32_000
    max_messages: int = 256
    max_stop: int = 4
    max_stop_chars: int = 256
    max_n: int = 16
    max_prompts: int = 32  # prompts in one completions request
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context)

    @property
    def max_body_bytes(self) -> int:
        return 16 * self.max_prompt_chars * max(1, self.max_prompts // 8) + 65_536
