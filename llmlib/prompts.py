"""From what a user asks to the token ids the model sees: one preparation for every entry point.

The Generator, the batching engine and the server all take a prompt in one of three forms (text,
a conversation, or token ids) and must agree on what the model is fed:

* **the chat template.** A chat model expects its conversation in its own format (SmolLM2 uses
  ChatML: ``<|im_start|>user ... <|im_end|>``). The template ships with the model as Jinja source
  (GGUF's ``tokenizer.chat_template``); :func:`render_chat` renders it the way Hugging Face's
  ``apply_chat_template`` does, in a sandbox, since templates come from model files.
* **special tokens.** The rendered template writes control tokens as text; they must become their
  ids, so it is encoded with every special token allowed. A user's own text is not: by default a
  ``<|im_end|>`` typed into a message cannot forge the template's structure.
* **BOS.** Some models expect a beginning-of-sequence token before a raw prompt
  (``tokenizer.add_bos``); templates write their own.
* **EOS.** Generation ends at any of the model's end tokens: the config's and the tokenizer's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

Message = dict[str, str]
Prompt = str | Sequence[Message] | Sequence[int]

# ChatML, SmolLM2's format, for tokenizers that carry no template of their own.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _compile_template(source: str) -> Any:
    # Hugging Face's settings: a sandbox (templates come from model files, i.e. from strangers),
    # trim_blocks/lstrip_blocks so `{% ... %}` lines leave no stray newlines or indentation, the
    # loop-control extension, and the helpers templates call (raise_exception, tojson, strftime_now).
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    **special_tokens: str,
) -> str:
    """Render a conversation with a model's Jinja chat template, as ``apply_chat_template`` does.

    ``messages`` is a list of ``{"role": ..., "content": ...}``; ``add_generation_prompt`` appends the
    header that opens the assistant's turn; ``special_tokens`` (bos_token, eos_token, ...) are
    passed to the template as variables, since many templates print them.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("render_chat needs a non-empty Jinja template string")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    return _compile_template(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **special_tokens
    )


def template_specials(tokenizer: Any) -> dict[str, str]:
    """The ``bos_token`` / ``eos_token`` texts a template may print, from the tokenizer's ids."""
    out = {}
    for name, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        i = getattr(tokenizer, attr, None)
        if i is not None:
            out[name] = tokenizer.id_to_bytes(i).decode("utf-8", errors="replace")
    return out


def chat_text(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    fallback: str | None = None,
) -> str:
    """The text the model sees for a conversation, from the tokenizer's own chat template.

    ``fallback`` is used when the tokenizer has none (the server falls back to ChatML); without
    one, a tokenizer with no template is an error.
    """
    template = getattr(tokenizer, "chat_template", None) or fallback
    if not template:
        raise ValueError(
            "this tokenizer has no chat template (tokenizer.chat_template is empty); use chat=False"
        )
    return render_chat(template, messages, add_generation_prompt, **template_specials(tokenizer))


def eos_token_ids(config: Any, tokenizer: Any = None) -> frozenset[int]:
    """Every token that ends generation: the model config's end tokens and the tokenizer's."""
    eos = set(getattr(config, "eos_token_ids", ()) or ())
    if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None:
        eos.add(int(tokenizer.eos_id))
    return frozenset(eos)


def is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "prompt") -> list[int]:
    """The ids as a list, or a ValueError naming the first one outside ``0..vocab_size - 1``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{what} token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
        )
    return list(ids)


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    *,
    chat: bool = False,
    vocab_size: int | None = None,
    allow_special: bool = False,
    fallback_template: str | None = None,
) -> tuple[str, list[int]]:
    """A prompt in any of its forms -> ``(the text the model sees, its token ids)``.

    * token ids pass through (checked against ``vocab_size`` when given), with text ``""``;
    * a conversation (a list of messages) is rendered with the chat template;
    * a string is one user message in the template when ``chat``, else raw text, with BOS in front
      when the tokenizer asks for it. ``allow_special`` lets special tokens written in raw text
      count as special (the completions convention); by default they are refused.
    """
    if isinstance(prompt, (list, tuple)) and not prompt:
        return "", []  # callers refuse an empty prompt with their own message
    if is_token_ids(prompt):
        ids = list(prompt)
        return "", check_token_ids(ids, vocab_size) if vocab_size is not None else ids
    if tokenizer is None:
        raise ValueError("no tokenizer: pass prompts as lists of token ids, or give a tokenizer")
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)):
        text = chat_text(tokenizer, prompt, fallback=fallback_template)
        # the template writes the special tokens as text; they must become their ids
        return text, list(tokenizer.encode(text, allowed_special="all"))
    if not isinstance(prompt, str):
        raise TypeError(
            "a prompt must be a str, a list of messages or a list of token ids, "
            f"got {type(prompt).__name__}"
        )
    ids = list(
        tokenizer.encode(prompt, allowed_special="all")
        if allow_special
        else tokenizer.encode(prompt)
    )
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id] + ids
    return prompt, ids
