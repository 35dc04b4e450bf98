"""Is temperature 0 reproducible? The same request's logits, alone and in every kind of company.

A request is *batch-invariant* when its logits at every step are bitwise the same whatever the
engine does around it. This module runs a set of prompts through :class:`llmlib.engine.LLM` in
the situations a server puts a request in, and compares each one's per-step logits and greedy
tokens with the same prompt run alone (whole prompt in one chunk, no prefix cache):

* ``batch-N``: the prompts in batches of ``N`` (4, 16, 64), all admitted at once;
* ``chunk-C``: alone, with at most ``C`` tokens per step, so the prompt is prefilled in chunks;
* ``preempted``: in a batch whose KV pool is too small, so sequences are preempted and
  recomputed (only requests that really were preempted are counted);
* ``prefix-hit``: alone, after a request with the same prompt filled the prefix cache, so its
  prompt's full blocks are read from the cache instead of computed.
* ``next-turn``: a conversation's next turn (the prompt, its answer and one token more), alone,
  and after the first turn left its blocks, the answer's included, in the prefix cache.

Per case: the largest absolute logit difference, the share of steps whose logits are bitwise
identical, and every greedy divergence (the prompt, the step, the two tokens). Steps after a
divergence are not compared (the two runs no longer condition on the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmlib.sampling import SamplingParams

#: the cases :func:`measure` runs by default
CASES = (
    "batch-4", "batch-16", "batch-64", "chunk-7", "chunk-32", "preempted", "prefix-hit",
    "next-turn",
)  # fmt: skip


@dataclass
class Run:
    """One request's result: greedy tokens and the logits each was chosen from ``[steps, V]``."""

    tokens: list[int]
    logits: torch.Tensor
    preempted: bool = False


@dataclass
class Divergence:
    prompt: int  # index into the prompt list
    step: int  # output position of the first different token
    alone: int  # token chosen alone
    other: int  # token chosen in this case
    gap_alone: float  # logit of the alone token minus the other's, alone (how near a tie it was)


@dataclass
class CaseResult:
    case: str
    requests: int = 0  # requests compared
    steps: int = 0  # steps compared (up to and including a first divergence)
    identical_steps: int = 0  # of those, steps with bitwise-identical logits
    identical_requests: int = 0  # requests whose every compared step was identical
    max_abs_diff: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def identical_share(self) -> float:
        return self.identical_steps / self.steps if self.steps else 1.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["identical_share"] = self.identical_share
        return d


def run_requests(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, batch: int | None = None
) -> list[Run]:
    """Greedy runs of ``prompts`` on ``llm``, ``batch`` at a time (None: all at once), each
    generating exactly ``max_tokens`` tokens; the logits are caught where the engine samples."""
    store: dict[str, list[torch.Tensor]] = {}
    runner = llm.runner
    orig = runner._sample

    def catching(sampled, logits, generators, res):
        for c, row in zip(sampled, logits):
            store.setdefault(c.seq.request_id, []).append(row.float().clone())
        return orig(sampled, logits, generators, res)

    runner._sample = catching
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs: list[Run] = []
    try:
        step = batch or len(prompts)
        for i in range(0, len(prompts), step):
            group = prompts[i : i + step]
            rids = [llm.add_request(list(p), params) for p in group]
            seqs = {r: llm._requests[r].choices[0].seq for r in rids}
            toks: dict[str, list[int]] = {}
            while llm.has_unfinished_requests():
                for out in llm.step():
                    if out.finished:
                        toks[out.request_id] = list(out.outputs[0].token_ids)
            for r in rids:
                runs.append(Run(toks[r], torch.stack(store.pop(r)), seqs[r].num_preemptions > 0))
    finally:
        runner._sample = orig
    return runs


def compare(case: str, alone: Sequence[Run], other: Sequence[Run]) -> CaseResult:
    """Step-by-step comparison of each request with its run alone."""
    res = CaseResult(case)
    for i, (a, b) in enumerate(zip(alone, other)):
        if case == "preempted" and not b.preempted:
            continue
        res.requests += 1
        same_all = True
        for s in range(min(len(a.tokens), len(b.tokens))):
            la, lb = a.logits[s], b.logits[s]
            res.steps += 1
            if torch.equal(la, lb):
                res.identical_steps += 1
            else:
                same_all = False
                res.max_abs_diff = max(res.max_abs_diff, float((la - lb).abs().max()))
            if a.tokens[s] != b.tokens[s]:
                gap = float(la[a.tokens[s]] - la[b.tokens[s]])
                res.divergences.append(Divergence(i, s, a.tokens[s], b.tokens[s], gap))
                break
        res.identical_requests += same_all
    return res


def measure(
    make_llm: Callable[..., Any],
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 32,
    cases: Sequence[str] = CASES,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, CaseResult]:
    """Run every case of ``cases`` and compare it with the prompts run alone.

    ``make_llm(**engine_kwargs)`` builds a fresh engine (the same model, the same mode) with
    the given overrides of ``enable_prefix_caching``, ``max_num_batched_tokens``, and for the
    preemption case ``num_blocks`` and ``block_size``.
    """
    longest = max(len(p) for p in prompts) + max_tokens
    base = {"enable_prefix_caching": False, "max_num_batched_tokens": max(512, longest)}
    alone = run_requests(make_llm(**base), prompts, max_tokens, batch=1)
    log(f"alone: {len(prompts)} requests")
    out: dict[str, CaseResult] = {}
    for case in cases:
        kind, _, arg = case.partition("-")
        if kind == "batch":
            runs = run_requests(make_llm(**base), prompts, max_tokens, batch=int(arg))
        elif kind == "chunk":
            llm = make_llm(**{**base, "max_num_batched_tokens": int(arg)})
            runs = run_requests(llm, prompts, max_tokens, batch=1)
        elif kind == "preempted":
            # small blocks, a pool for about a third of the batch's final lengths, and no
            # admission headroom: sequences grow into each other and the newest is preempted,
            # then recomputed from its prompt and the tokens it had generated
            bs = 4
            need = sum(-(-(len(p) + max_tokens) // bs) for p in prompts[:16])
            blocks = max(need // 3, -(-longest // bs) + 2)
            llm = make_llm(**{**base, "num_blocks": blocks, "block_size": bs})
            llm.scheduler.headroom_blocks_per_seq = 0
            llm.scheduler.watermark_blocks = 0
            runs = run_requests(llm, prompts, max_tokens, batch=16)
        elif kind == "prefix":
            llm = make_llm(**{**base, "enable_prefix_caching": True})
            runs = []
            for p in prompts:
                run_requests(llm, [p], 1, batch=1)  # fills the cache with p's full blocks
                runs += run_requests(llm, [p], max_tokens, batch=1)
        elif kind == "next":
            # the reference is the next turn alone; then each first turn, and its next turn
            # on the same engine, whose prefix cache now holds the first turn's answer
            turns = [[*p, *a.tokens, a.tokens[-1]] for p, a in zip(prompts, alone)]
            ref = run_requests(make_llm(**base), turns, max_tokens, batch=1)
            llm = make_llm(**{**base, "enable_prefix_caching": True})
            runs = []
            for p, t in zip(prompts, turns):
                run_requests(llm, [p], max_tokens, batch=1)
                runs += run_requests(llm, [t], max_tokens, batch=1)
        else:
            raise ValueError(f"unknown case {case!r}; cases look like {CASES}")
        out[case] = r = compare(case, ref if kind == "next" else alone, runs)
        log(
            f"{case:>10}: {r.requests} requests, {r.identical_share:.1%} of {r.steps} steps "
            f"bitwise identical, max |diff| {r.max_abs_diff:.3g}, "
            f"{len(r.divergences)} greedy divergences"
        )
    return out


def prompts_from_text(
    tokenizer: Any, text: str, n: int, lengths: tuple[int, int] = (8, 160), seed: int = 0
) -> list[list[int]]:
    """``n`` prompts cut from ``text`` at spread-out places, of lengths spread over ``lengths``."""
    import random

    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    lo, hi = lengths
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out
