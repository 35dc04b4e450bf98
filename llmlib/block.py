"""The transformer block: normalise, attend, add back; normalise, feed forward, add back.

The residual stream ``x`` runs straight through every block; each sub-layer only reads a
normalised copy of it and *adds* its result. That is why a 30-layer model trains at all, and why
the block is two lines in :meth:`Block.forward`.

* :class:`RMSNorm` — rescale each token vector to unit root-mean-square, then a learned gain.
* :class:`FeedForward` — SwiGLU (Shazeer, GLU variants): ``w_down(silu(w_gate x) * w_up x)``.
* :class:`MoEFeedForward` — Mixtral-style mixture of experts: a router scores ``E`` SwiGLU experts
  per token, the top ``k`` run, their outputs are mixed by the renormalised router weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmlib.attention import AttendingCache, Attention, KVCacheLike, register_fused_linear
from llmlib.config import ModelConfig
from llmlib.linear import linear


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 whatever the model's dtype.

    Unlike LayerNorm there is no mean subtraction and no bias: cheaper, and it works as well.
    The float32 detour matters in bfloat16, where the sum of squares would otherwise lose bits.
    """

    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.dtype == self.weight.dtype:
            # PyTorch's fused kernel: one call instead of five; it sums in float32 whatever the
            # input's dtype (only the gain is applied before rounding back, not after)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class FeedForward(nn.Module):
    """SwiGLU: a gated two-layer MLP. The gate decides, per hidden unit, how much of ``w_up x`` passes.

    State-dict names ``w_gate``, ``w_up``, ``w_down``; gate and up are one fused matrix internally.
    """

    def __init__(self, d_model: int, ffn_dim: int, device: torch.device | str | None = None):
        super().__init__()
        self.ffn_dim = ffn_dim
        self.w_gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False, device=device)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False, device=device)
        register_fused_linear(self, "w_gate_up", [("w_gate", ffn_dim), ("w_up", ffn_dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # linear() on the weights directly: the same product without nn.Module's per-call bookkeeping
        gate, up = linear(x, self.w_gate_up.weight).split(self.ffn_dim, dim=-1)
        return linear(F.silu(gate) * up, self.w_down.weight)


class MoEFeedForward(nn.Module):
    """Mixture of experts, Mixtral-style top-k routing.

    Every token gets a softmax over ``E`` router scores; the ``k`` best experts run on it and their
    outputs are summed, weighted by those ``k`` probabilities renormalised to sum to one. Each
    expert sees only the tokens routed to it, so a token pays for ``k`` FFNs, not ``E``.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False, device=device)
        self.experts = nn.ModuleList(
            FeedForward(d_model, ffn_dim, device) for _ in range(n_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] float32, expert ids [N, k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():  # only the experts some token picked
            token, slot = torch.where(idx == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.view(shape)


class Block(nn.Module):
    """One layer: ``x += attn(attn_norm(x))``; ``x += ffn(ffn_norm(x))``."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int = 0, device: torch.device | str | None = None
    ):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.attn = Attention(cfg, layer_idx, device)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        if cfg.n_experts:
            self.ffn: nn.Module = MoEFeedForward(
                cfg.d_model, cfg.ffn_dim, cfg.n_experts, cfg.n_experts_per_token, device
            )
        else:
            self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | AttendingCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, cache)
        return x + self.ffn(self.ffn_norm(x))
