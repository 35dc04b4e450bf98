"""The generate loop: prefill the prompt, then decode one token per forward pass.

``Generator(model, tokenizer)`` serves one request at a time with a static KV cache (chapter 8) and
the samplers of chapter 7. Prefill runs the whole prompt through the model in one pass and fills the
cache; each decode step feeds back only the token just chosen. Generation ends at an end-of-sequence
token, at a stop string, or after ``max_new_tokens``; the result says which (``stop`` or ``length``)
and carries the timings of every step.

Streaming yields text pieces as tokens arrive. A token can end in the middle of a UTF-8 character
(byte-level BPE splits an emoji or a Chinese character across tokens), so pieces come from an
incremental UTF-8 decoder that holds back an incomplete character until its last byte arrives.

Chat models expect their conversation wrapped in the model's own template (SmolLM2 uses ChatML,
``<|im_start|>user ... <|im_end|>``). The template ships with the model (the GGUF metadata key
``tokenizer.chat_template``) as Jinja source; :func:`render_chat` renders it the way Hugging Face's
``apply_chat_template`` does, so the model sees the same tokens it was trained on.
"""
from __future__ import annotations

import argparse
import codecs
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from llmlib.kv_cache import KVCache
from llmlib.sampling import SamplingParams, sample
from llmlib.stopping import find_stop, held_back

Message = dict[str, str]


# ---- the chat template -----------------------------------------------------------------------

def _compile_template(source: str):
    # Hugging Face's settings: a sandbox (templates come from model files, i.e. from strangers),
    # trim_blocks/lstrip_blocks so `{% ... %}` lines leave no stray newlines or indentation, the
    # loop-control extension, and the helpers templates call (raise_exception, tojson, strftime_now).
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(template: str, messages: Sequence[Message], add_generation_prompt: bool = True,
                **special_tokens: str) -> str:
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
    return _compile_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                              **special_tokens)


# ---- results ---------------------------------------------------------------------------------

@dataclass
class Timing:
    """Wall-clock seconds of one generation. The first new token comes out of prefill."""

    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # one entry per decode step

    @property
    def decode_s(self) -> float:
        return float(sum(self.step_s))

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed alone: tokens per second of the one-token steps."""
        return len(self.step_s) / self.decode_s if self.step_s and self.decode_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole time, prefill included (what a user waits for)."""
        n = len(self.step_s) + (1 if self.prefill_s else 0)
        return n / self.total_s if self.total_s > 0 else float("nan")


@dataclass
class GenerationResult:
    text: str  # the new text (without the prompt, without a stop string or the EOS token)
    token_ids: list[int]  # the new tokens, including a final EOS token when one ended generation
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens or the context)
    timing: Timing
    prompt_ids: list[int] = field(default_factory=list)
    prompt: str = ""  # the prompt as the model saw it (after the chat template)
    token_texts: list[str] = field(default_factory=list)  # each new token on its own (bytes → text)


# ---- the generator ---------------------------------------------------------------------------

class Generator:
    """One request at a time: a model, its tokenizer and a static KV cache reused across calls.

    On the CPU each weight matrix is stored in the layout that makes decode's matrix-vector products
    fastest (:func:`llmlib.loading.use_matvec_layout`; :func:`llmlib.loading.load_model` already
    does this on CPU, so for a loaded model this is a no-op); ``decode_layout=False`` leaves the
    model untouched.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_len: int | None = None,
                 decode_layout: bool | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if decode_layout if decode_layout is not None else self.device.type == "cpu":
            from llmlib.loading import use_matvec_layout

            use_matvec_layout(model)
        self.max_len = min(self.config.max_seq_len, max_len or self.config.max_seq_len)
        eos = set(self.config.eos_token_ids or ())
        if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None:
            eos.add(int(tokenizer.eos_id))
        self.eos_ids = frozenset(eos)
        self._cache: KVCache | None = None
        # positions 0..max_len-1 once; each step takes a view instead of building a tensor
        self._positions = torch.arange(self.max_len, device=self.device).unsqueeze(0)
        self.last_result: GenerationResult | None = None

    # -- prompts --
    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The text the model sees for a conversation, from the tokenizer's own chat template."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is empty); use chat=False")
        specials = {}
        for name, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
            i = getattr(self.tokenizer, attr, None)
            if i is not None:
                specials[name] = self.tokenizer.id_to_bytes(i).decode("utf-8", errors="replace")
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **specials)

    def encode_prompt(self, prompt: str | Sequence[Message] | Sequence[int], chat: bool = False) -> tuple[str, list[int]]:
        """Prompt text (str), a conversation (list of messages) or ready token ids → (text, ids)."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return "", list(prompt)
        if isinstance(prompt, (list, tuple)):  # a conversation
            text = self.chat_prompt(prompt)
            # the template writes the special tokens as text; they must become their ids
            return text, self.tokenizer.encode(text, allowed_special="all")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, a list of messages or a list of token ids, got {type(prompt).__name__}")
        if chat:
            text = self.chat_prompt([{"role": "user", "content": prompt}])
            return text, self.tokenizer.encode(text, allowed_special="all")
        ids = self.tokenizer.encode(prompt)
        if getattr(self.tokenizer, "add_bos", False) and self.tokenizer.bos_id is not None:
            ids = [self.tokenizer.bos_id] + ids
        return prompt, ids

    def _cache_for(self, tokens: int) -> KVCache:
        # Reuse the cache while it is big enough; otherwise allocate one rounded up to 256 tokens
        # (capped at the context) so a slightly longer next request does not reallocate.
        if self._cache is None or self._cache.max_len < tokens:
            size = min(self.max_len, -(-tokens // 256) * 256)
            self._cache = None  # free the old one first
            self._cache = KVCache.from_config(self.config, batch=1, max_len=size, device=self.device, dtype=self.dtype)
        self._cache.reset()
        return self._cache

    # -- the token loop --
    def _tokens(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                timing: Timing) -> Iterator[int]:
        """Yield new token ids: prefill once, then one forward pass per token. Fills ``timing``."""
        n = len(prompt_ids)
        cache = self._cache_for(n + max_new_tokens)
        gens = [params.make_generator(self.device)]
        seen = [list(prompt_ids)] if params.repetition_penalty != 1.0 else None
        model = self.model

        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
            # last_only: the LM head runs on the last position only (the prompt's other logits are unused)
            logits = model(ids, self._positions[:, :n], cache, last_only=True)
            tok = sample(logits[:, -1], [params], gens, seen)
        tid = int(tok[0])  # the one host sync per step: we need the id for EOS, stops and text
        timing.prefill_s = time.perf_counter() - t0
        yield tid
        for pos in range(n, n + max_new_tokens - 1):
            if seen is not None:
                seen[0].append(tid)
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = model(tok.view(1, 1), self._positions[:, pos : pos + 1], cache, last_only=True)
                tok = sample(logits[:, -1], [params], gens, seen)
            tid = int(tok[0])
            timing.step_s.append(time.perf_counter() - t0)
            yield tid

    def _prepare(self, prompt, max_new_tokens: int, params: SamplingParams, chat: bool) -> tuple[str, list[int], int]:
        """Check the request and tokenize the prompt: (prompt text, prompt ids, token budget)."""
        text_prompt, prompt_ids = self.encode_prompt(prompt, chat=chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens): nothing to continue from")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must be in 0..{self.config.vocab_size - 1}, got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) >= self.max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}: "
                f"no room to generate; shorten the prompt")
        return text_prompt, prompt_ids, min(max_new_tokens, self.max_len - len(prompt_ids))

    def _run(self, text_prompt: str, prompt_ids: list[int], budget: int, params: SamplingParams) -> Iterator[str]:
        """The shared core of generate and stream: yields text pieces, stores ``self.last_result``."""
        stops = params.stop
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        timing = Timing()
        result = GenerationResult(text="", token_ids=[], finish_reason="length", timing=timing,
                                  prompt_ids=prompt_ids, prompt=text_prompt)
        self.last_result = None
        text, emitted, hit_stop_string = "", 0, False
        for tid in self._tokens(prompt_ids, params, budget, timing):
            result.token_ids.append(tid)
            raw = self.tokenizer.id_to_bytes(tid)
            result.token_texts.append(raw.decode("utf-8", errors="replace"))
            if tid in self.eos_ids and not params.ignore_eos:
                result.finish_reason = "stop"
                break
            piece = decoder.decode(raw)
            text += piece
            if stops:
                hit = find_stop(text, stops, len(text) - len(piece))
                if hit is not None:
                    text, hit_stop_string = text[:hit], True
                    result.finish_reason = "stop"
                    break
            safe = len(text) - held_back(text, stops)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        if not hit_stop_string:
            text += decoder.decode(b"", final=True)  # a dangling partial character becomes U+FFFD
        if len(text) > emitted:
            yield text[emitted:]
        result.text = text
        self.last_result = result

    def _params(self, temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, stop, ignore_eos):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_new_tokens,
                              stop=list(stop) if isinstance(stop, (list, tuple)) else (stop or []),
                              ignore_eos=ignore_eos)

    def generate(self, prompt: str | Sequence[Message] | Sequence[int], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, seed: int | None = 0, stop: str | Sequence[str] | None = None,
                 chat: bool = False, repetition_penalty: float = 1.0, ignore_eos: bool = False) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, a list of chat messages, or token ids).

        ``chat=True`` wraps a text prompt as one user message in the model's chat template.
        Temperature 0 (the default) is greedy decoding; ``seed`` fixes the random draws otherwise.
        """
        params = self._params(temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, stop, ignore_eos)
        for _ in self._run(*self._prepare(prompt, max_new_tokens, params, chat), params):
            pass
        assert self.last_result is not None
        return self.last_result

    def stream(self, prompt: str | Sequence[Message] | Sequence[int], max_new_tokens: int = 64,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               min_p: float | None = None, seed: int | None = 0, stop: str | Sequence[str] | None = None,
               chat: bool = False, repetition_penalty: float = 1.0, ignore_eos: bool = False) -> Iterator[str]:
        """Like :meth:`generate`, but yield text pieces as they are decoded (never half a character).

        ``"".join(pieces)`` equals ``generate(...).text``; the full result is in ``self.last_result``
        once the iterator is exhausted.
        """
        params = self._params(temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, stop, ignore_eos)
        # check and tokenize now, so a bad request fails at the call, not at the first next()
        return self._run(*self._prepare(prompt, max_new_tokens, params, chat), params)


def timed_run(gen: Generator, prompt: str, max_new_tokens: int = 32, chat: bool = False) -> GenerationResult:
    """Greedy generation with every step timed, for chapter 1's walk through the inference path.

    The result holds the prompt's token ids, each new token's text, the prefill seconds and the list
    of decode-step seconds (``result.timing.step_s``).
    """
    return gen.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, chat=chat)


# ---- command line ----------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct, fetched if missing)")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def load(model_path: str | None, device: str | None = None, dtype: str | None = None) -> Generator:
    """Load a model and its tokenizer from a .gguf file or an HF folder into a Generator."""
    from llmlib.fetch import resolve_model_path
    from llmlib.loading import load_model
    from llmlib.tokenizer import load_tokenizer

    path = resolve_model_path(model_path)
    model = load_model(path, device=device, dtype=_DTYPES[dtype] if dtype else None)
    tok_path = path
    if path.is_dir():
        tok_path = next((p for p in (path / "tokenizer.json",) if p.exists()), None) or next(path.glob("*.tiktoken"), None)
        if tok_path is None:
            raise FileNotFoundError(f"no tokenizer.json or *.tiktoken in {path}")
    return Generator(model, load_tokenizer(tok_path))


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib generate", description="Generate text from a prompt (streams by default).")
    ap.add_argument("prompt", help="the prompt text")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (the default when the model has one)")
    mode.add_argument("--no-chat", dest="chat", action="store_false", help="feed the prompt as raw text")
    ap.add_argument("--no-stream", action="store_true", help="print the text only when done")
    ap.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    add_model_args(ap)
    add_sampling_args(ap)
    args = ap.parse_args(argv)
    try:
        SamplingParams(**{k: v for k, v in sampling_kwargs(args).items() if k != "stop"}, stop=args.stop or [],
                       max_tokens=max(1, args.max_new_tokens))
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        gen = load(args.model, args.device, args.dtype)
        # An instruction-tuned model answers a bare question badly (SmolLM2's first greedy token
        # after one is its end-of-turn token), so chat is the default whenever a template exists.
        chat = args.chat if args.chat is not None else bool(getattr(gen.tokenizer, "chat_template", None))
        kw = dict(max_new_tokens=args.max_new_tokens, chat=chat, **sampling_kwargs(args))
        if args.no_stream:
            out = gen.generate(args.prompt, **kw)
            print(out.text)
        else:
            for piece in gen.stream(args.prompt, **kw):
                print(piece, end="", flush=True)
            print()
            out = gen.last_result
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"llmlib generate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet and out is not None:
        t = out.timing
        print(f"[{len(out.prompt_ids)} prompt tokens, {len(out.token_ids)} new, finish={out.finish_reason}; "
              f"prefill {t.prefill_s * 1e3:.0f} ms, decode {t.decode_tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0
