"""From a validated request body to what the engine runs: prompt ids and :class:`SamplingParams`.

The models of :mod:`llmlib.serve.protocol` check types and fixed bounds; this module checks what
depends on the server and the model: the model id, prompt characters and tokens against the
context, ``max_tokens`` against what the context leaves, the number of stop strings and choices,
token ids inside the vocabulary, and a ``response_format`` schema the grammar engine can compile.
Every refusal is an :class:`~llmlib.serve.protocol.APIError` naming the field.

Special tokens. A completions prompt is raw text, and special tokens written in it are parsed as
those tokens (``<|im_end|>`` becomes its id), the convention of vLLM and llama.cpp: a client that
builds its own template needs that. Chat message content is the user's text inside the server's
template, so a special token written there is refused: a message cannot forge the template's
control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmlib.engine.stopping import ContextLengthError, check_length
from llmlib.prompts import CHATML, chat_text
from llmlib.sampling import SamplingParams
from llmlib.serve.client import EngineClient
from llmlib.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Limits,
    SamplingFields,
    bad,
)


@dataclass
class Prepared:
    """One request, ready for the engine: a prompt per set of choices, and their params."""

    prompts: list[list[int]]
    params: SamplingParams
    chat: bool
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # completions: top-k per token; chat: top_logprobs
    texts: list[str] = field(default_factory=list)  # each prompt's text, for echo


def check_model(name: str | None, served: set[str], required: bool = True) -> None:
    if name is None and not required:
        return
    if name not in served:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves {', '.join(sorted(served))}",
            "model",
            "model_not_found",
        )


def _refuse_unsupported(body: SamplingFields) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise bad(f"'best_of' must equal 'n' ({body.n}) if given", "best_of", "unsupported")
    for name in ("suffix", "tools", "functions", "tool_choice"):
        v = getattr(body, name, None)
        if v not in (None, [], "", "none"):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported")


def _encode(client: EngineClient, text: str, param: str, allow_special: bool) -> list[int]:
    try:
        return client.encode(text, allow_special=allow_special)
    except ValueError as e:  # a special token typed into chat content
        raise bad(f"'{param}' cannot be tokenized: {e}", param) from e


def _schema(client: EngineClient, body: SamplingFields) -> dict | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        schema: dict = {"type": "object"}
    else:
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad(
                "'response_format.json_schema.schema' is required for type json_schema",
                "response_format.json_schema.schema",
                "missing_field",
            )
        schema = rf.json_schema.schema_
    try:
        client.check_schema(schema)
    except ValueError as e:
        raise bad(str(e), "response_format", "invalid_schema") from e
    return schema


def _fits(client: EngineClient, prompt_len: int, where: str) -> None:
    """A 400 naming ``where`` unless the prompt leaves room in the context
    (:func:`llmlib.engine.stopping.check_length`)."""
    try:
        check_length(prompt_len, 0, client.context_len)
    except ContextLengthError as e:
        raise bad(e.describe(where), where, "context_length_exceeded") from None


def sampling(
    client: EngineClient,
    limits: Limits,
    body: SamplingFields,
    prompt_len: int,
    chat: bool,
    echo: bool = False,
) -> SamplingParams:
    """The request's :class:`SamplingParams`, with every bound that depends on the context."""
    ctx = client.context_len
    where = "messages" if chat else "prompt"
    key = "max_tokens"
    max_tokens = body.max_tokens
    if chat and getattr(body, "max_completion_tokens", None) is not None:
        key, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        room = max(ctx - prompt_len, 1)
        max_tokens = min(room, limits.default_max_tokens) if chat else min(room, 16)
    if max_tokens < (0 if echo else 1):
        raise bad(f"'{key}' must be at least 1 (0 only with echo), got {max_tokens}", key)
    try:
        check_length(prompt_len, max_tokens, ctx)
    except ContextLengthError as e:
        field = where if e.field == "prompt" else key
        raise bad(e.describe(where, f"'{key}'"), field, "context_length_exceeded") from None
    if body.n > limits.max_n:
        raise bad(f"'n' must be at most {limits.max_n}, got {body.n}", "n")
    if body.top_k == 0:
        raise bad("'top_k' must be -1 (off) or at least 1, got 0", "top_k")
    if body.min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({body.min_tokens}) exceeds '{key}' ({max_tokens})", "min_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in stop):
        raise bad(
            f"'stop' takes at most {limits.max_stop} strings of at most {limits.max_stop_chars} "
            "characters",
            "stop",
        )
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", "stop")
    vocab = client.vocab_size
    bias: dict[int, float] = {}
    for k, v in (body.logit_bias or {}).items():
        if not (k.isdigit() and int(k) < vocab) or not -100.0 <= v <= 100.0:
            raise bad(
                f"'logit_bias' maps token ids in 0..{vocab - 1} to biases in [-100, 100]; got "
                f"{k!r}: {v}",
                "logit_bias",
            )
        bias[int(k)] = float(v)
    stop_ids = list(body.stop_token_ids or [])
    if any(not 0 <= t < vocab for t in stop_ids):
        raise bad(f"'stop_token_ids' must lie in 0..{vocab - 1}", "stop_token_ids")
    if chat:
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = logprobs if echo and logprobs is not None else None
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # max_tokens=0 with echo scores the prompt
    return SamplingParams(
        temperature=body.temperature,
        top_k=None if body.top_k in (None, -1) else body.top_k,
        top_p=None if body.top_p == 1.0 else body.top_p,
        min_p=None if body.min_p == 0 else body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias or None,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        json_schema=_schema(client, body),
    )


def _stream_flags(body: SamplingFields) -> tuple[bool, bool]:
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return body.stream, usage


def completion(client: EngineClient, limits: Limits, body: CompletionRequest) -> Prepared:
    _refuse_unsupported(body)
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise bad("'prompt' must not be empty", "prompt")
    if len(prompts) > limits.max_prompts:
        raise bad(
            f"'prompt' holds {len(prompts)} prompts; the limit is {limits.max_prompts}", "prompt"
        )
    ids_list, texts, chars = [], [], 0
    for one in prompts:
        if isinstance(one, str):
            chars += len(one)
            if not one:
                raise bad("'prompt' must not be empty", "prompt")
            ids = client.bos() + _encode(client, one, "prompt", allow_special=True)
            texts.append(one)
        else:
            if not one:
                raise bad("'prompt' token lists must not be empty", "prompt")
            if any(not 0 <= t < client.vocab_size for t in one):
                raise bad(f"'prompt' token ids must lie in 0..{client.vocab_size - 1}", "prompt")
            ids = list(one)
            texts.append(client.decode(ids) if body.echo else "")
        _fits(client, len(ids), "prompt")
        ids_list.append(ids)
    if chars > limits.max_prompt_chars:
        raise bad(
            f"'prompt' has {chars} characters; the limit is {limits.max_prompt_chars}",
            "prompt",
            "prompt_too_long",
        )
    longest = max(len(i) for i in ids_list)
    params = sampling(client, limits, body, longest, chat=False, echo=body.echo)
    stream, usage = _stream_flags(body)
    return Prepared(ids_list, params, False, stream, usage, body.echo, body.logprobs, texts)


def chat_prompt(
    client: EngineClient, limits: Limits, messages: list[ChatMessage], gen: bool
) -> str:
    """The conversation rendered with the model's chat template (ChatML when it has none)."""
    if len(messages) > limits.max_messages:
        raise bad(
            f"'messages' has {len(messages)} entries; the limit is {limits.max_messages}",
            "messages",
        )
    clean, chars = [], 0
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        _encode(client, content, f"messages[{i}].content", allow_special=False)
        chars += len(content)
        clean.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    if chars > limits.max_prompt_chars:
        raise bad(
            f"'messages' hold {chars} characters; the limit is {limits.max_prompt_chars}",
            "messages",
            "prompt_too_long",
        )
    from jinja2.exceptions import TemplateError

    try:
        return chat_text(client.tokenizer, clean, add_generation_prompt=gen, fallback=CHATML)
    except TemplateError as e:
        raise bad(f"the chat template rejected these messages: {e}", "messages") from e


def chat(client: EngineClient, limits: Limits, body: ChatCompletionRequest) -> Prepared:
    _refuse_unsupported(body)
    text = chat_prompt(client, limits, body.messages, body.add_generation_prompt)
    ids = _encode(client, text, "messages", allow_special=True)
    _fits(client, len(ids), "messages")
    params = sampling(client, limits, body, len(ids), chat=True)
    stream, usage = _stream_flags(body)
    top = params.logprobs
    return Prepared([ids], params, True, stream, usage, False, top, [text])
