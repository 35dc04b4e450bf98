"""The generate loop: prefill the prompt, then decode one token per forward pass.

``Generator(model, tokenizer)`` serves one request at a time with a static KV cache (chapter 8) and
the samplers of chapter 7. Prefill runs the whole prompt through the model in one pass and fills the
cache; each decode step feeds back only the token just chosen. Generation ends at an end-of-sequence
token, at a stop string, or after ``max_tokens``; the result says which (``stop`` or ``length``)
and carries the timings of every step.

A request is the same :class:`~llmlib.sampling.SamplingParams` the batching engine takes; the
prompt goes through the same preparation (:mod:`llmlib.prompts`: chat template, BOS, end tokens)
and the tokens back through the same text pipeline (:class:`llmlib.text.TextStream`: UTF-8 across
tokens, stop strings, held-back text) as in the engine and the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmlib.kernels.prepare import Format, prepare
from llmlib.model.kv_cache import KVCache
from llmlib.prompts import Message, Prompt, chat_text, encode_prompt, eos_token_ids
from llmlib.runtime.compile import compile_decode
from llmlib.runtime.static import StaticKVCache
from llmlib.sampling import SamplingParams, sample
from llmlib.speculative import SpecStats, SpeculativeConfig, Speculator
from llmlib.text import TextStream

# ---- results ---------------------------------------------------------------------------------


@dataclass
class Timing:
    """Wall-clock seconds of one generation. The first new token comes out of prefill."""

    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # one entry per decode step
    # tokens each step produced, where a step may produce several (speculative decoding);
    # empty: one each
    step_tokens: list[int] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        return sum(self.step_tokens) if self.step_tokens else len(self.step_s)

    @property
    def decode_s(self) -> float:
        return float(sum(self.step_s))

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed alone: tokens per second of the steps after prefill."""
        return (
            self.decode_tokens / self.decode_s
            if self.step_s and self.decode_s > 0
            else float("nan")
        )

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole time, prefill included (what a user waits for)."""
        n = self.decode_tokens + (1 if self.prefill_s else 0)
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
    speculative: SpecStats | None = None  # proposed/accepted counts, with speculative decoding


# ---- the generator ---------------------------------------------------------------------------

#: The Generator's defaults for its keyword convenience: greedy, reproducible, 64 new tokens.
DEFAULTS: dict[str, Any] = dict(max_new_tokens=64, temperature=0.0, seed=0)


class Generator:
    """One request at a time: a model, its tokenizer and a static KV cache reused across calls.

    A model that was built rather than loaded (:func:`llmlib.model.random_model`) gets its matrices
    stored for this machine's kernels first (:func:`llmlib.kernels.prepare.prepare`;
    :func:`llmlib.load_model` already does this, so for a loaded model nothing changes);
    ``decode_layout=False`` leaves the model untouched.

    ``compile=True`` hands the decode step to ``torch.compile`` (:func:`llmlib.runtime.compile.compile_decode`).
    On the CPU, a bfloat16 model's oneDNN-blocked matrices then go back to plain ones, which a
    frozen graph packs for itself: the compiling Generator owns its model's layout.

    ``speculative`` (a :class:`~llmlib.speculative.SpeculativeConfig`) turns on speculative
    decoding: the output is the same (greedy) or has the same distribution (sampling); requests
    with penalties or a logit bias decode plainly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_len: int | None = None,
        decode_layout: bool | None = None,
        compile: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        p = next(model.parameters())
        self.device = p.device
        self.dtype = getattr(model, "dtype", p.dtype)  # activations and KV cache: the model's dtype
        if decode_layout is not False and not hasattr(model, "weight_format"):
            prepare(model, Format(self.device, self.dtype))
        self.max_len = min(self.config.max_seq_len, max_len or self.config.max_seq_len)
        self.eos_ids = eos_token_ids(self.config, tokenizer)
        self._cache: KVCache | None = None
        # positions 0..max_len-1 once; each step takes a view instead of building a tensor
        self._positions = torch.arange(self.max_len, device=self.device).unsqueeze(0)
        self.last_result: GenerationResult | None = None
        # The decode step: eager (the reference the book reads), or compiled (inductor fuses each
        # layer's small operators into a few C++/Triton kernels). A model loaded from a file, on a
        # CPU, in float32 or bfloat16, compiles ahead of time once per machine and loads the
        # compiled step from disk on every later start (llmlib.runtime.aot); otherwise
        # torch.compile compiles it in memory, lazily, on the first request
        # (llmlib.runtime.compile). ``compile_s`` is what compiling cost this process;
        # ``decode_path`` says which step runs.
        self.compile = bool(compile)
        self._step = decode_step
        self.compile_s: float | None = None
        self.decode_path = "eager"
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}"
            )
        if speculative is not None and self.compile:
            raise ValueError("speculative decoding runs eagerly: pass compile=False")
        if self.compile:  # after the checks: compile_decode may re-store the model's matrices
            self._step, self.decode_path = self._compiled_step(model)
        self.speculator = Speculator(speculative, model) if speculative is not None else None

    def _compiled_step(self, model: torch.nn.Module) -> tuple[Any, str]:
        from llmlib.runtime import aot

        # on the CPU, from a package on disk: code only (float32, or int8/int4 codes that the
        # integer kernels read as extern calls), or frozen (all-bfloat16); in memory otherwise
        if self.device.type == "cpu":
            t0 = time.perf_counter()
            step, cached = aot.load_decode_step(model, log=aot.print_progress)
            if step is not None:
                if not cached:
                    self.compile_s = time.perf_counter() - t0
                return step, "compiled (from the cache)" if cached else "compiled (now, cached)"
        return compile_decode(decode_step, model), "compiled (in memory)"

    @property
    def weight_format(self) -> str:
        """What the weights are held in (``float32``, ``gguf (int4 g32 x210, int8 x1) / bfloat16``)."""
        return getattr(self.model, "weight_format", str(self.dtype).removeprefix("torch."))

    def warmup(self) -> float:
        """Run (and, compiled, compile) the decode step on a throwaway cache; return seconds."""
        t0 = time.perf_counter()
        self.generate([1, 2], max_new_tokens=3, ignore_eos=True)
        dt = time.perf_counter() - t0
        if self.decode_path == "compiled (in memory)" and self.compile_s is None:
            self.compile_s = dt
        return dt

    # -- prompts --
    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The text the model sees for a conversation, from the tokenizer's own chat template."""
        return chat_text(self.tokenizer, messages, add_generation_prompt)

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> tuple[str, list[int]]:
        """Prompt text (str), a conversation (list of messages) or ready token ids -> (text, ids)."""
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def _cache_for(self, tokens: int) -> KVCache | StaticKVCache:
        # Reuse the cache while it is big enough; otherwise allocate one rounded up to 256 tokens
        # (capped at the context) so a slightly longer next request does not reallocate.
        if self._cache is None or self._cache.max_len < tokens:
            size = min(self.max_len, -(-tokens // 256) * 256)
            self._cache = None  # free the old one first
            if self.compile:
                # fixed shapes for the compiled step: every step attends over all the slots under
                # a mask built from the positions tensor, so no Python length changes a shape
                # (a changing one would recompile the graph)
                self._cache = StaticKVCache(self.config, 1, size, self.device, self.dtype)
            else:
                self._cache = KVCache.from_config(
                    self.config, batch=1, max_len=size, device=self.device, dtype=self.dtype
                )
        if isinstance(self._cache, KVCache):
            self._cache.reset()
        return self._cache

    # -- the token loop --
    def _tokens(
        self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, timing: Timing
    ) -> Iterator[int]:
        """Yield new token ids: prefill once, then one forward pass per token. Fills ``timing``."""
        n = len(prompt_ids)
        cache = self._cache_for(n + max_new_tokens)
        gens = [params.make_generator(self.device)]
        seen = [list(prompt_ids)] if params.penalized else None
        outs: list[list[int]] = [[]]  # generated tokens, for presence/frequency penalties
        model = self.model

        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
            # last_only: the LM head runs on the last position only (the prompt's other logits are unused)
            logits = model(ids, self._positions[:, :n], cache, last_only=True)
            tok = sample(logits[:, -1], [params], gens, seen, outs)
        tid = int(tok[0])  # the one host sync per step: we need the id for EOS, stops and text
        timing.prefill_s = time.perf_counter() - t0
        yield tid
        if self.speculator is not None and not params.penalized:
            self._stats = SpecStats()
            yield from self.speculator.decode(
                [*prompt_ids, tid], cache, self._positions, params, gens[0],
                max_new_tokens - 1, timing, self._stats,
            )  # fmt: skip
            return
        for pos in range(n, n + max_new_tokens - 1):
            if seen is not None:
                seen[0].append(tid)
                outs[0].append(tid)
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = self._step(model, tok.view(1, 1), self._positions[:, pos : pos + 1], cache)
                tok = sample(logits[:, -1], [params], gens, seen, outs)
            tid = int(tok[0])
            timing.step_s.append(time.perf_counter() - t0)
            yield tid

    def _prepare(
        self, prompt: Prompt, params: SamplingParams, chat: bool
    ) -> tuple[str, list[int], int]:
        """Check the request and tokenize the prompt: (prompt text, prompt ids, token budget)."""
        text_prompt, prompt_ids = self.encode_prompt(prompt, chat=chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens): nothing to continue from")
        V = self.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= V:
            raise ValueError(
                f"prompt token ids must be in 0..{V - 1}, got {min(prompt_ids)}..{max(prompt_ids)}"
            )
        if len(prompt_ids) >= self.max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}: "
                f"no room to generate; shorten the prompt"
            )
        return text_prompt, prompt_ids, min(params.max_tokens, self.max_len - len(prompt_ids))

    def _run(
        self, text_prompt: str, prompt_ids: list[int], budget: int, params: SamplingParams
    ) -> Iterator[str]:
        """The shared core of generate and stream: yields text pieces, stores ``self.last_result``."""
        text = TextStream(self.tokenizer.id_to_bytes, params.stop)
        timing = Timing()
        result = GenerationResult(
            text="",
            token_ids=[],
            finish_reason="length",
            timing=timing,
            prompt_ids=prompt_ids,
            prompt=text_prompt,
        )
        self.last_result = None
        self._stats: SpecStats | None = None
        for tid in self._tokens(prompt_ids, params, budget, timing):
            result.token_ids.append(tid)
            result.token_texts.append(
                self.tokenizer.id_to_bytes(tid).decode("utf-8", errors="replace")
            )
            if tid in self.eos_ids and not params.ignore_eos:
                result.finish_reason = "stop"
                break
            if text.add_token(tid):
                result.finish_reason = "stop"
                break
            piece = text.delta()
            if piece:
                yield piece
        text.close()
        piece = text.delta()
        if piece:
            yield piece
        result.text = text.text
        result.speculative = self._stats
        self.last_result = result

    def _request(self, params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        """A SamplingParams as given, or built from the keyword convenience (:data:`DEFAULTS`)."""
        if params is not None:
            if kwargs:
                raise TypeError(
                    f"pass either a SamplingParams or keyword arguments, not both "
                    f"(got {sorted(kwargs)})"
                )
            if not isinstance(params, SamplingParams):
                raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
            return params
        kw = {**DEFAULTS, **kwargs}
        n = kw.pop("max_new_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
        if isinstance(kw.get("stop"), (list, tuple)):
            kw["stop"] = list(kw["stop"])
        elif kw.get("stop") is None:
            kw["stop"] = []
        return SamplingParams(max_tokens=n, **kw)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        **kwargs: Any,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, a list of chat messages, or token ids).

        ``params`` is a :class:`~llmlib.sampling.SamplingParams`; or give its fields as keywords
        (``max_new_tokens`` for ``max_tokens``), with greedy decoding, ``seed=0`` and 64 new tokens
        as the defaults. ``chat=True`` wraps a text prompt as one user message in the model's chat
        template.
        """
        params = self._request(params, kwargs)
        for _ in self._run(*self._prepare(prompt, params, chat), params):
            pass
        assert self.last_result is not None
        return self.last_result

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        **kwargs: Any,
    ) -> Iterator[str]:
        """Like :meth:`generate`, but yield text pieces as they are decoded (never half a character).

        ``"".join(pieces)`` equals ``generate(...).text``; the full result is in ``self.last_result``
        once the iterator is exhausted.
        """
        params = self._request(params, kwargs)
        # check and tokenize now, so a bad request fails at the call, not at the first next()
        return self._run(*self._prepare(prompt, params, chat), params)


def decode_step(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """One decode step, ``ids [B, 1]`` at ``positions`` -> logits ``[B, 1, vocab]``: the function
    :class:`Generator` runs eagerly or hands to ``torch.compile``."""
    return model(ids, positions, cache, last_only=True)


def load_generator(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    *,
    group_size: int = 32,
    compile: bool = False,
    speculative: SpeculativeConfig | None = None,
) -> Generator:
    """A Generator on a model file or folder and its tokenizer (``None``: the book's SmolLM2),
    with the weights in ``dtype``/``quantization`` (:func:`llmlib.load_model`)."""
    from llmlib.checkpoints import load_model, load_tokenizer_for, resolve_model_path

    path = resolve_model_path(path)
    model = load_model(path, device, dtype, quantization, group_size=group_size)
    return Generator(model, load_tokenizer_for(path), compile=compile, speculative=speculative)
