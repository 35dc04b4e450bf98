"""Verification: which proposed tokens the model keeps, so the output is the model's own.

The model scores the pending token and the k proposed ones in one forward pass, which gives its
distribution ``p_i`` at every proposed position and one more, ``p_{k+1}``, after the last.

Greedy: keep the longest prefix of proposals equal to the model's argmax, then add the model's
own argmax at the first disagreement (or, when all k agree, after the last: the bonus token).
Every kept token is one plain greedy decoding would have chosen.

Sampling (Leviathan et al. 2023; Chen et al. 2023): proposal ``d_i`` drawn from the draft's
``q_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first refusal a token is
drawn from the residual ``max(0, p_i - q_i)``, renormalised, and verification stops. Why this is
exact: a token x comes out at position i either by being proposed and kept,
``q(x) min(1, p(x)/q(x)) = min(q(x), p(x))``, or by a refusal (probability
``1 - sum_y min(p(y), q(y))``, the residual's mass) followed by a residual draw,
``max(0, p(x) - q(x))``; the two add up to ``p(x)``. A deterministic proposer (prompt lookup)
has a one-hot ``q``: its token is kept with probability ``p(d)``, and the residual is ``p`` with
``d`` removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmlib.sampling import SamplingParams, _filters, _param_tensors, draw, filter_logits


def distributions(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits ``[T, V]`` -> the distributions one draw with ``params`` would use, ``[T, V]``
    (temperature, top-k, top-p, min-p, as :func:`llmlib.sampling.sample` applies them)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if _filters(params):
        t = [
            x.expand(logits.shape[0])
            for x in _param_tensors([params], logits.shape[1], logits.device)
        ]
        return filter_logits(logits, *t).softmax(-1)
    return (logits / params.temperature).softmax(-1)


def accept_greedy(proposed: Sequence[int], logits: torch.Tensor) -> tuple[int, int]:
    """``(accepted, next_token)``: how many proposals equal the model's argmax, and the model's
    token after them. ``logits`` ``[k + 1, V]`` score the pending token and the k proposals."""
    best = logits.argmax(-1).tolist()
    a = 0
    while a < len(proposed) and proposed[a] == best[a]:
        a += 1
    return a, best[a]


def accept_sampled(
    proposed: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """``(accepted, next_token)`` by rejection sampling (the module docstring says why it is exact).

    ``target_probs`` ``[k + 1, V]`` are the model's distributions, ``draft_probs`` ``[k, V]`` the
    proposer's (None: a deterministic proposer, one-hot on each proposal).
    """
    k = len(proposed)
    if k:
        d = torch.tensor(list(proposed), device=target_probs.device)
        p = target_probs[:k].gather(1, d[:, None])[:, 0]
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, d[:, None])[:, 0]
        u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
        keep = (u * q < p).tolist()  # u < p/q without dividing by a zero q
        for i in range(k):
            if not keep[i]:
                if draft_probs is None:
                    residual = target_probs[i].clone()
                    residual[proposed[i]] = 0.0
                else:
                    residual = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
                if not float(residual.sum()) > 0:  # only by rounding: p and q agree here
                    residual = target_probs[i]
                return i, int(draw(residual[None], [generator])[0])
    return k, int(draw(target_probs[k : k + 1], [generator])[0])
