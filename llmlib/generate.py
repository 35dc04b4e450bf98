"""The generate loop: prefill the prompt, then decode one token per forward pass.

``Generator(model, tokenizer)`` serves one request at a time with a static KV cache (chapter 8) and
the samplers of chapter 7. Prefill runs the whole prompt through the model in one pass and fills the
cache; each decode step feeds back only the token just chosen. Generation ends at an end token, at a
stop string, at a finished grammar, or after ``max_tokens``; the result says which (``stop`` or
``length``) and carries the timings of every step.

It is the book's loop, eager and readable in one sitting: what ``llmlib generate`` runs is the
batching engine with one sequence (:class:`llmlib.LLM`, fixed-shape steps, compiled where that
pays). The two share everything around the loop: a request is the same
:class:`~llmlib.sampling.SamplingParams`, the prompt goes through the same preparation
(:mod:`llmlib.prompts`), the same checks decide whether it fits and when it ends, and what it may
not sample before then (:mod:`llmlib.engine.stopping`), and the tokens come back through the same
text pipeline (:class:`llmlib.text.TextStream`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmlib.engine.sequence import Sequence
from llmlib.engine.stopping import check_length, constrain, take
from llmlib.kernels.prepare import Format, prepare
from llmlib.model.kv_cache import KVCache
from llmlib.prompts import Message, Prompt, chat_text, encode_prompt, eos_token_ids
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

    ``speculative`` (a :class:`~llmlib.speculative.SpeculativeConfig`) turns on speculative
    decoding: the output is the same (greedy) or has the same distribution (sampling); requests
    with penalties, a grammar or ``min_tokens`` decode plainly. What the loop does not do (``n``
    choices, log-probabilities) the batching engine does: such a request is refused, by name.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_len: int | None = None,
        decode_layout: bool | None = None,
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
        self._grammars: Any = None  # llmlib.structured.Grammars, made on the first json_schema
        # positions 0..max_len-1 once; each step takes a view instead of building a tensor
        self._positions = torch.arange(self.max_len, device=self.device).unsqueeze(0)
        self.last_result: GenerationResult | None = None
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}"
            )
        self.speculator = Speculator(speculative, model) if speculative is not None else None

    @property
    def weight_format(self) -> str:
        """What the weights are held in (``float32``, ``gguf (int4 g32 x210, int8 x1) / bfloat16``)."""
        return getattr(self.model, "weight_format", str(self.dtype).removeprefix("torch."))

    def warmup(self) -> float:
        """Run a throwaway request (the first calls allocate caches and pick kernels); seconds."""
        t0 = time.perf_counter()
        self.generate([1, 2], max_new_tokens=3, ignore_eos=True)
        return time.perf_counter() - t0

    # -- prompts --
    def chat_prompt(self, messages: Seq[Message], add_generation_prompt: bool = True) -> str:
        """The text the model sees for a conversation, from the tokenizer's own chat template."""
        return chat_text(self.tokenizer, messages, add_generation_prompt)

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> tuple[str, list[int]]:
        """Prompt text (str), a conversation (list of messages) or ready token ids -> (text, ids)."""
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def _cache_for(self, tokens: int) -> KVCache:
        # Reuse the cache while it is big enough; otherwise allocate one rounded up to 256 tokens
        # (capped at the context) so a slightly longer next request does not reallocate.
        if self._cache is None or self._cache.max_len < tokens:
            size = min(self.max_len, -(-tokens // 256) * 256)
            self._cache = None  # free the old one first
            self._cache = KVCache.from_config(
                self.config, batch=1, max_len=size, device=self.device, dtype=self.dtype
            )
        self._cache.reset()
        return self._cache

    # -- the token loop --
    def _tokens(self, seq: Sequence, timing: Timing) -> Iterator[int]:
        """Yield new token ids: prefill once, then one forward pass per token. Fills ``timing``.

        The caller appends each token to ``seq`` before asking for the next, so what the next
        one may be (:func:`~llmlib.engine.stopping.constrain`) sees it."""
        prompt_ids, params = seq.prompt_token_ids, seq.params
        n, budget = len(prompt_ids), seq.max_tokens
        cache = self._cache_for(n + budget)
        gens = [params.make_generator(self.device)]
        penalized = params.penalized
        model = self.model

        def pick(logits: torch.Tensor) -> torch.Tensor:
            seen = [seq.token_ids] if penalized else None
            outs = [seq.output_token_ids] if penalized else None
            return sample(constrain(logits, [seq]), [params], gens, seen, outs)

        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
            # last_only: the LM head runs on the last position only (the prompt's other logits are unused)
            logits = model(ids, self._positions[:, :n], cache, last_only=True)
            tok = pick(logits[:, -1])
        tid = int(tok[0])  # the one host sync per step: we need the id for EOS, stops and text
        timing.prefill_s = time.perf_counter() - t0
        yield tid
        if self._stats is not None:  # speculative decoding
            yield from self.speculator.decode(
                [*prompt_ids, tid], cache, self._positions, params, gens[0],
                budget - 1, timing, self._stats,
            )  # fmt: skip
            return
        for pos in range(n, n + budget - 1):
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = model(tok.view(1, 1), self._positions[:, pos : pos + 1], cache)
                tok = pick(logits[:, -1])
            tid = int(tok[0])
            timing.step_s.append(time.perf_counter() - t0)
            yield tid

    def _prepare(self, prompt: Prompt, params: SamplingParams, chat: bool) -> tuple[str, Sequence]:
        """Check the request and tokenize the prompt: (prompt text, its sequence)."""
        refused = [
            name
            for name, on in (
                ("n > 1", params.n > 1),
                ("logprobs", params.logprobs is not None),
                ("prompt_logprobs", params.prompt_logprobs is not None),
            )
            if on
        ]
        if refused:
            raise ValueError(
                f"the Generator decodes one choice without log-probabilities ({', '.join(refused)} "
                "asked): the batching engine, llmlib.LLM, serves them"
            )
        text_prompt, prompt_ids = self.encode_prompt(prompt, chat=chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens): nothing to continue from")
        V = self.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= V:
            raise ValueError(
                f"prompt token ids must be in 0..{V - 1}, got {min(prompt_ids)}..{max(prompt_ids)}"
            )
        check_length(len(prompt_ids), params.max_tokens, self.max_len)
        seq = Sequence(
            seq_id=0,
            prompt_token_ids=list(prompt_ids),
            max_tokens=params.max_tokens,
            eos_token_ids=frozenset(self.eos_ids),
            ignore_eos=params.ignore_eos,
            params=params,
            stop_token_ids=frozenset(params.stop_token_ids),
            matcher=None if params.json_schema is None else self._matcher(params.json_schema),
        )
        seq.text = TextStream(
            self.tokenizer.id_to_bytes, params.stop, include_stop=params.include_stop_str_in_output
        )
        return text_prompt, seq

    def _matcher(self, schema: Any) -> Any:
        """A grammar position for ``schema`` (structured output, :mod:`llmlib.structured`)."""
        if self._grammars is None:
            from llmlib.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.eos_ids)
        return self._grammars.matcher(schema)

    def _run(self, text_prompt: str, seq: Sequence) -> Iterator[str]:
        """The shared core of generate and stream: yields text pieces, stores ``self.last_result``.
        Each token is appended to the request's sequence, and the engine's own decision says
        whether it ends there (:func:`llmlib.engine.stopping.take`)."""
        timing = Timing()
        result = GenerationResult(
            text="",
            token_ids=[],
            finish_reason="",  # what take() decides: a request always ends by its rule
            timing=timing,
            prompt_ids=list(seq.prompt_token_ids),
            prompt=text_prompt,
        )
        self.last_result = None
        # speculative decoding, unless the next token depends on more than the model's scores
        params = seq.params
        plain = params.penalized or seq.matcher is not None or params.min_tokens > 1
        self._stats = SpecStats() if self.speculator is not None and not plain else None
        text = seq.text
        for tid in self._tokens(seq, timing):
            seq.token_ids.append(tid)
            result.token_ids.append(tid)
            result.token_texts.append(
                self.tokenizer.id_to_bytes(tid).decode("utf-8", errors="replace")
            )
            reason = take(seq, tid, self.max_len)
            piece = text.delta()
            if piece:
                yield piece
            if reason is not None:
                result.finish_reason = reason
                break
        text.close()
        piece = text.delta()
        if piece:
            yield piece
        result.text = text.text[: text.emitted]
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
        for _ in self._run(*self._prepare(prompt, params, chat)):
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
        return self._run(*self._prepare(prompt, params, chat))


def load_generator(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    *,
    group_size: int = 32,
    speculative: SpeculativeConfig | None = None,
) -> Generator:
    """A Generator on a model file or folder and its tokenizer (``None``: the book's SmolLM2),
    with the weights in ``dtype``/``quantization`` (:func:`llmlib.load_model`)."""
    from llmlib.checkpoints import load_model, load_tokenizer_for, resolve_model_path

    path = resolve_model_path(path)
    model = load_model(path, device, dtype, quantization, group_size=group_size)
    return Generator(model, load_tokenizer_for(path), speculative=speculative)
