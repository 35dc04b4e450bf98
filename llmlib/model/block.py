"""The transformer block: normalise, attend, add back; normalise, feed forward, add back.

The residual stream ``x`` runs straight through every block; each sub-layer only reads a
normalised copy of it and *adds* its result. That is why a 30-layer model trains at all, and why
the block is two lines in :meth:`Block.forward`.

* :class:`RMSNorm` — rescale each token vector to unit root-mean-square, then a learned gain
  (defined in :mod:`llmlib.model.norm`, which attention uses too).
* :class:`FeedForward` — SwiGLU (Shazeer, GLU variants): ``w_down(silu(w_gate x) * w_up x)``;
  Gemma's GeGLU is the same with a tanh-approximated GELU as the gate.
* :class:`MoEFeedForward` — Mixtral-style mixture of experts: a router scores ``E`` SwiGLU experts
  per token, the top ``k`` run, their outputs are mixed by the renormalised router weights.
* :class:`Block` — Llama's block; :class:`PostNormBlock` — Gemma's, with a second norm on each
  sub-layer's output before it is added. :func:`make_block` picks one from the config.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmlib.config import ModelConfig
from llmlib.model.attention import Attention, KVCacheLike, register_fused_linear
from llmlib.model.norm import RMSNorm

__all__ = ["Block", "FeedForward", "MoEFeedForward", "PostNormBlock", "RMSNorm", "make_block"]

#: The gate's non-linearity by config name: SiLU (SwiGLU), or GELU's tanh approximation (GeGLU).
GATES = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """SwiGLU: a gated two-layer MLP. The gate decides, per hidden unit, how much of ``w_up x`` passes.

    State-dict names ``w_gate``, ``w_up``, ``w_down``; gate and up are one fused matrix internally.
    ``activation="gelu_tanh"`` makes it GeGLU (Gemma).
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        device: torch.device | str | None = None,
        activation: str = "silu",
    ):
        super().__init__()
        self.ffn_dim = ffn_dim
        self.gate = GATES[activation]
        self.w_gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False, device=device)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False, device=device)
        register_fused_linear(self, "w_gate_up", [("w_gate", ffn_dim), ("w_up", ffn_dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.ffn_dim, dim=-1)
        return self.w_down(self.gate(gate) * up)


class MoEFeedForward(nn.Module):
    """Mixture of experts, Mixtral-style top-k routing.

    Every token gets a softmax over ``E`` router scores; the ``k`` best experts run on it and their
    outputs are summed, weighted by those ``k`` probabilities renormalised to sum to one. Each
    expert sees only the tokens routed to it, so a token pays for ``k`` FFNs, not ``E``.
    ``norm_topk=False`` (Qwen3-MoE's ``norm_topk_prob: false``) keeps the ``k`` probabilities as
    the softmax over all ``E`` gave them, summing to less than one.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        device: torch.device | str | None = None,
        norm_topk: bool = True,
        activation: str = "silu",
    ):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.router = nn.Linear(d_model, n_experts, bias=False, device=device)
        self.experts = nn.ModuleList(
            FeedForward(d_model, ffn_dim, device, activation) for _ in range(n_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] float32, expert ids [N, k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx

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
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, cfg.norm_offset)
        self.attn = Attention(cfg, layer_idx, device)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, cfg.norm_offset)
        if cfg.is_moe(layer_idx):
            self.ffn: nn.Module = MoEFeedForward(
                cfg.d_model,
                cfg.expert_dim,
                cfg.n_experts,
                cfg.n_experts_per_token,
                device,
                cfg.norm_topk_prob,
                cfg.activation,
            )
        else:
            self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, device, cfg.activation)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, cache)
        return x + self.ffn(self.ffn_norm(x))


class PostNormBlock(Block):
    """Gemma 2 and 3: each sub-layer's output is normalised once more before it is added,
    ``x += post_norm(attn(attn_norm(x)))``, the same for the FFN (four norms per block)."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int = 0, device: torch.device | str | None = None
    ):
        super().__init__(cfg, layer_idx, device)
        self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, cfg.norm_offset)
        self.ffn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, cfg.norm_offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | None = None,
    ) -> torch.Tensor:
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), cos, sin, positions, cache))
        return x + self.ffn_post_norm(self.ffn(self.ffn_norm(x)))


def make_block(
    cfg: ModelConfig, layer_idx: int = 0, device: torch.device | str | None = None
) -> Block:
    """Layer ``layer_idx`` of a model of ``cfg``: a :class:`PostNormBlock` where the family has
    post-norms, else Llama's :class:`Block`."""
    return (PostNormBlock if cfg.post_norms else Block)(cfg, layer_idx, device)
