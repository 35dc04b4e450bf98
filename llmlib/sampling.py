"""Sampling: turning the last position's logits into the next token.

The model hands us one row of logits per sequence in the batch. Every knob here reshapes that row
before a single draw: a repetition penalty pushes down tokens already seen, temperature sharpens or
flattens the distribution, and top-k, top-p and min-p cut off its long tail. Temperature 0 skips the
draw altogether and takes the argmax (greedy decoding).

Each row of a batch carries its own :class:`SamplingParams` and its own ``torch.Generator``, so the
batching engine of chapter 10 can serve requests with different settings in one forward pass, and a
seed reproduces one request's continuation no matter what else shares the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_N = 128  # choices per request (a server bounds it further)
MAX_LOGPROBS = 20  # top log-probabilities per token, OpenAI's bound
MAX_LOGIT_BIAS = 300  # entries in logit_bias, OpenAI's bound


@dataclass
class SamplingParams:
    """How to pick tokens for one request (the names follow vLLM's ``SamplingParams``).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
    top_k: keep only the k most likely tokens (None = off).
    top_p: keep the smallest set of most likely tokens whose probabilities sum to at least p
        (nucleus sampling; None or 1.0 = off).
    min_p: drop tokens whose probability is below ``min_p`` times the top token's (None or 0 = off).
    repetition_penalty: >1 discourages tokens that already appear in the prompt or output
        (the CTRL rule that Hugging Face uses: divide a positive logit, multiply a negative one).
    seed: seeds this request's own ``torch.Generator``; None draws from torch's global generator.
    max_tokens: the most new tokens to generate.
    stop: strings that end generation when they appear in the output (not included in the text,
        unless ``include_stop_str_in_output``).
    ignore_eos: keep generating past the end-of-sequence token.

    The rest follows OpenAI's API and vLLM's extensions of it:

    n: how many independent completions (choices) of the one prompt; the engine computes the
        prompt once and forks its KV blocks, and choice ``i`` draws from seed ``seed + i``.
    presence_penalty, frequency_penalty: in [-2, 2]; subtract ``presence`` from the logit of every
        token already generated, and ``frequency`` times how often it was generated (output
        tokens only, OpenAI's rule; ``repetition_penalty`` also counts the prompt).
    logit_bias: ``{token id: bias}``, each bias in [-100, 100], added to the logits.
    stop_token_ids: tokens that end generation like EOS does (also under ``ignore_eos``).
    min_tokens: EOS and ``stop_token_ids`` are masked out, and stop strings not looked for,
        until this many tokens have been generated.
    include_stop_str_in_output: keep the stop string that ended the text in it.
    logprobs: report the log-probability of every sampled token and of the ``logprobs`` most
        likely ones (0 = the sampled token's only; at most 20). They are the log-softmax of the
        model's raw logits, before penalties, bias, temperature and the top-k/p filters, as vLLM
        reports them: what the model thinks, not what the sampler drew from.
    prompt_logprobs: the same for every prompt token (the first has none); the prompt is then
        computed in full, never taken from the prefix cache.
    json_schema: the output must be JSON valid against this schema (``{"type": "object"}`` for
        any JSON object), enforced token by token by a grammar (:mod:`llmlib.structured`).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | None = None

    def __post_init__(self) -> None:
        def real(name: str, v: object) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be finite, got {v!r}")
            return float(v)

        def integer(name: str, v: object) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__}")
            return v

        if real("temperature", self.temperature) < 0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k is not None and integer("top_k", self.top_k) < 1:
            raise ValueError(f"SamplingParams.top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0.0 < real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] or None, got {self.top_p}")
        if self.min_p is not None and not 0.0 <= real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] or None, got {self.min_p}")
        if real("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if self.seed is not None and integer("seed", self.seed) < 0:
            raise ValueError(
                f"SamplingParams.seed must be a non-negative int or None, got {self.seed}"
            )
        if integer("max_tokens", self.max_tokens) < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(
                f"SamplingParams.max_tokens must be >= 1 (0 only to score a prompt with "
                f"prompt_logprobs), got {self.max_tokens}"
            )
        if isinstance(self.stop, str):  # a single stop string is a common slip; accept it
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise TypeError(f"SamplingParams.stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain the empty string")
        self.stop = list(self.stop)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SamplingParams.{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        self._check_openai_fields(real, integer)

    def _check_openai_fields(self, real, integer) -> None:
        if not 1 <= integer("n", self.n) <= MAX_N:
            raise ValueError(f"SamplingParams.n must be in 1..{MAX_N}, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= real(name, getattr(self, name)) <= 2.0:
                raise ValueError(
                    f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}"
                )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"SamplingParams.logit_bias must be a dict of at most {MAX_LOGIT_BIAS} entries"
                )
            bias = {}
            for k, v in self.logit_bias.items():
                if integer("logit_bias key", k) < 0 or not -100.0 <= real("logit_bias", v) <= 100.0:
                    raise ValueError(
                        f"SamplingParams.logit_bias maps token ids >= 0 to biases in [-100, 100], "
                        f"got {k!r}: {v!r}"
                    )
                bias[k] = float(v)
            self.logit_bias = bias or None
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError("SamplingParams.stop_token_ids must be a list of token ids")
        for t in self.stop_token_ids:
            if integer("stop_token_ids", t) < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {t}")
        self.stop_token_ids = list(self.stop_token_ids)
        if integer("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= integer(name, v) <= MAX_LOGPROBS:
                raise ValueError(
                    f"SamplingParams.{name} must be in 0..{MAX_LOGPROBS} or None, got {v}"
                )
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise TypeError("SamplingParams.json_schema must be a dict (a JSON schema)")

    @property
    def penalized(self) -> bool:
        """Does any penalty or bias change the logits (so the sampler needs the tokens seen)?"""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """This request's own random stream (None when unseeded: torch's global one is used)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


# ---- the pieces, each on a [B, V] batch of float logits ----------------------------------------


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Penalize every token in ``seen`` [B, N] (ids; pad with any id already in the row) by ``penalty`` [B].

    The CTRL rule: a positive logit is divided by the penalty and a negative one multiplied, so the
    token always becomes less likely when penalty > 1. Returns a new tensor.
    """
    picked = logits.gather(1, seen)
    p = penalty.to(logits.dtype).unsqueeze(1)
    picked = torch.where(picked > 0, picked / p, picked * p)
    return logits.scatter(1, seen, picked)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seen: Sequence[Sequence[int]] | None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Every row's repetition penalty (prompt and output tokens, ``seen``), presence and frequency
    penalties (generated tokens, ``outputs``, OpenAI's rule: ``logit - count * frequency -
    (count > 0) * presence``) and logit bias. Returns a new tensor; rows without any are untouched."""
    logits = logits.clone()
    V = logits.shape[1]
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        row = logits[i : i + 1]
        if p.repetition_penalty != 1.0:
            if seen is None:
                raise ValueError(
                    "a repetition_penalty needs the tokens seen so far (the `seen` argument)"
                )
            if len(seen[i]):
                ids = torch.tensor([list(seen[i])], device=logits.device)
                pen = torch.tensor([p.repetition_penalty], device=logits.device)
                row = apply_repetition_penalty(row, ids, pen)
        if p.presence_penalty or p.frequency_penalty:
            if outputs is None:
                raise ValueError(
                    "presence and frequency penalties need the generated tokens (`outputs`)"
                )
            if len(outputs[i]):
                ids = torch.tensor(list(outputs[i]), device=logits.device)
                counts = torch.bincount(ids, minlength=V)[:V].to(row.dtype)
                row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < V], device=logits.device)
            vals = torch.tensor(
                [p.logit_bias[t] for t in p.logit_bias if t < V], device=logits.device
            )
            row = row.index_add(1, ids, vals.to(row.dtype).unsqueeze(0))
        logits[i : i + 1] = row
    return logits


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, per row; removed tokens get -inf.

    All arguments after ``logits`` [B, V] are [B] tensors: temperature > 0; top_k in 1..V (V = off);
    top_p in (0, 1] (1 = off); min_p in [0, 1] (0 = off). One descending sort serves all three cuts.
    """
    V = logits.shape[1]
    scaled = logits / temperature.to(logits.dtype).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)  # [1, V]
    drop = rank >= top_k.unsqueeze(1)  # top-k: everything past the k-th place
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p: drop a token when the tokens ranked above it already reach p (so the top one always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p.to(probs.dtype).unsqueeze(1))
    # min-p: drop tokens far less likely than the best one (probs[:, :1] is the top token's)
    drop = drop | (probs < min_p.to(probs.dtype).unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # never empty a row
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _param_tensors(params: Sequence[SamplingParams], vocab: int, device: torch.device):
    t = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params], device=device)
    tp = torch.tensor([p.top_p if p.top_p is not None else 1.0 for p in params], device=device)
    mp = torch.tensor([p.min_p if p.min_p is not None else 0.0 for p in params], device=device)
    return t, k, tp, mp


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a ``[B, V]`` tensor: the same indices (each row's first maximum, NaN
    counting as one), found as the maximum of every chunk of columns, then the first chunk
    holding the row's maximum. On the CPU this is faster than one argmax along a vocabulary-long
    row; ``tests/test_sampling.py`` checks that both give the same indices."""
    B, V = x.shape
    chunk = 4096  # the largest power of two up to this that divides the vocabulary
    while chunk > 256 and V % chunk:
        chunk //= 2
    if x.device.type != "cpu" or V % chunk or V < 4 * chunk:
        return x.argmax(dim=-1)
    best, where = x.view(B, V // chunk, chunk).max(dim=-1)
    c = best.argmax(dim=-1, keepdim=True)
    return (c * chunk + where.gather(1, c)).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    seen: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V], each row with its own params and generator.

    ``seen`` lists, per row, the token ids the repetition penalty applies to (prompt and output so
    far), ``outputs`` the generated ones the presence and frequency penalties count; both are only
    read for rows that are penalized (:func:`apply_penalties`). Returns a LongTensor [B] on the
    logits' device. Rows that are all greedy take the fast path: one argmax, no sort, no softmax.
    """
    if logits.dim() != 2:
        raise ValueError(
            f"sample expects logits of shape [batch, vocab], got {tuple(logits.shape)}"
        )
    B, V = logits.shape
    if len(params) != B:
        raise ValueError(f"sample got {len(params)} SamplingParams for a batch of {B} rows")
    if generators is not None and len(generators) != B:
        raise ValueError(f"sample got {len(generators)} generators for a batch of {B} rows")
    if any(p.penalized for p in params):
        logits = apply_penalties(logits.float(), params, seen, outputs)

    greedy = [p.greedy for p in params]
    out = argmax_rows(logits)  # in the logits' own dtype: converting first costs a full pass
    if all(greedy):
        return out
    logits = logits.float()
    rows = [i for i, g in enumerate(greedy) if not g]
    sub = logits[rows]
    kept = [params[i] for i in rows]
    if any(_filters(p) for p in kept):
        filtered = filter_logits(sub, *_param_tensors(kept, V, logits.device))
    else:  # temperature alone: no sort needed (the sort is most of a draw's cost)
        filtered = sub / torch.tensor([p.temperature for p in kept], device=sub.device).unsqueeze(1)
    probs = filtered.softmax(dim=-1)
    gens = [generators[i] if generators is not None else None for i in rows]
    out[rows] = draw(probs, gens)
    return out


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V], by inverting the row's cumulative distribution at a
    uniform draw from the row's own generator (torch's global one where None): a row consumes
    only its own random stream, and all rows share one cumulative sum and one search."""
    cdf = probs.cumsum(dim=-1)
    u = torch.empty(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype)
    free = [r for r, g in enumerate(generators) if g is None]
    if free:
        u[free] = torch.rand(len(free), 1, device=probs.device, dtype=cdf.dtype)
    for r, g in enumerate(generators):
        if g is not None:
            u[r] = torch.rand(1, generator=g, device=probs.device, dtype=cdf.dtype)
    # right=True: the first token whose cumulative mass passes u, so one of zero mass never wins
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return idx.clamp_(max=probs.shape[1] - 1)


def _filters(p: SamplingParams) -> bool:
    """Does any of top-k, top-p, min-p cut this row's distribution?"""
    return bool(p.top_k) or (p.top_p is not None and p.top_p < 1.0) or bool(p.min_p)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one draw would use for a 1-D row of logits (for the book's figures).

    Greedy params give a one-hot on the argmax.
    """
    if logits.dim() != 1:
        raise ValueError(
            f"probabilities expects a 1-D row of logits, got shape {tuple(logits.shape)}"
        )
    row = logits.float().unsqueeze(0)
    if params.greedy:
        return torch.zeros_like(row[0]).scatter(0, row[0].argmax().view(1), 1.0)
    return filter_logits(row, *_param_tensors([params], row.shape[-1], row.device)).softmax(-1)[0]
