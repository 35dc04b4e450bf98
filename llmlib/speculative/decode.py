"""The speculative decode loop: propose k tokens, verify them in one forward pass, roll back.

Decode reads every weight once per step whatever the number of new tokens, so on hardware whose
step is bound by reading weights, scoring the pending token and k proposals costs about one step.
Each verification keeps ``accepted + 1`` tokens (the proposals the model agrees with, then its own
token), at least one, so the loop is never slower in tokens per step than plain decoding; it is
slower in time only by what the proposer and the longer pass cost.

Rollback: the verification pass stores keys and values for all k + 1 positions; the cache's
``length`` is then cut back to the tokens kept. Nothing past ``length`` is ever read: the next
pass writes its own keys there before attending (:meth:`llmlib.model.kv_cache.KVCache.update`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmlib.model.kv_cache import KVCache
from llmlib.sampling import SamplingParams, draw
from llmlib.speculative.config import SpeculativeConfig
from llmlib.speculative.proposers import Chooser, Proposer, make_proposer
from llmlib.speculative.verify import accept_greedy, accept_sampled, distributions


@dataclass
class SpecStats:
    """What speculation did for one request."""

    proposed: int = 0  # tokens the proposer offered
    accepted: int = 0  # of those, tokens the model kept
    verifications: int = 0  # forward passes of the model after prefill

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Proposals kept per verification (each verification adds one token of its own)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    @property
    def tokens_per_step(self) -> float:
        return 1.0 + self.mean_accepted

    def as_dict(self) -> dict[str, float]:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verifications": self.verifications,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted": round(self.mean_accepted, 4),
        }


def chooser(params: SamplingParams, generator: torch.Generator | None) -> Chooser:
    """How a model draft picks its token: argmax when greedy, else a draw from the distribution
    the request's settings give (which verification then needs, so it is returned too)."""
    if params.greedy:
        return lambda logits: (int(logits.argmax()), None)

    def choose(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = distributions(logits[None], params)
        return int(draw(q, [generator])[0]), q[0]

    return choose


class Speculator:
    """A proposer and the verify loop, for :class:`llmlib.Generator` (one request at a time)."""

    def __init__(self, spec: SpeculativeConfig, model: torch.nn.Module) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.model = model
        self.proposer: Proposer = make_proposer(spec, model)

    def decode(
        self,
        seq: list[int],
        cache: KVCache,
        positions: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        budget: int,
        timing: Any,
        stats: SpecStats,
    ) -> Iterator[int]:
        """Yield up to ``budget`` tokens after ``seq`` (the prompt and the first token, which the
        cache does not hold yet). Appends every step's seconds and token count to ``timing``."""
        self.proposer.start(cache)
        choose = chooser(params, generator)
        seq = list(seq)
        while budget > 0:
            t0 = time.perf_counter()
            n = cache.length
            k = min(self.k, budget - 1, cache.max_len - n - 1)
            prop = self.proposer.propose(seq, k, choose) if k > 0 else None
            drafts = prop.tokens[:k] if prop is not None else []
            ids = torch.tensor([[seq[-1], *drafts]], device=positions.device)
            with torch.inference_mode():
                logits = self.model(ids, positions[:, n : n + ids.shape[1]], cache)[0]
                if params.greedy:
                    a, nxt = accept_greedy(drafts, logits)
                else:
                    q = None if prop is None or prop.probs is None else prop.probs[: len(drafts)]
                    a, nxt = accept_sampled(drafts, q, distributions(logits, params), generator)
            cache.truncate(n + 1 + a)  # keep the pending token and the accepted proposals
            new = [*drafts[:a], nxt]
            stats.proposed += len(drafts)
            stats.accepted += a
            stats.verifications += 1
            timing.step_s.append(time.perf_counter() - t0)
            timing.step_tokens.append(len(new))
            for t in new:
                seq.append(t)
                budget -= 1
                yield t
