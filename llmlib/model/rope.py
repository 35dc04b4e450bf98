"""Rotary position embeddings (RoPE): positions enter attention as rotations of query and key pairs.

Each head vector of size ``head_dim`` is cut into ``head_dim / 2`` pairs of numbers. Pair ``i`` at
position ``p`` is rotated by the angle ``p * inv_freq[i]``. Because a rotation by ``a`` followed by
the inverse of a rotation by ``b`` is a rotation by ``a - b``, the dot product of a rotated query and a
rotated key depends only on the distance between their positions (Su et al., RoFormer).

Two conventions decide *which* numbers form a pair:

* ``"split_half"`` (Hugging Face checkpoints, and llmlib's own weights): pair ``i`` is
  ``(x[i], x[i + head_dim/2])``.
* ``"interleaved"`` (the original paper, Meta's reference code, llama.cpp): pair ``i`` is
  ``(x[2i], x[2i+1])``.

They compute the same thing once the rows of ``W_q`` and ``W_k`` are permuted to match
(:func:`interleaved_to_split_half_perm`). The model uses split-half; the other layout is kept here so
the book can show the equivalence and so the GGUF reader can undo llama.cpp's permutation.

The cos/sin tables are computed once per model (:class:`RotaryTables`) for every position up to
``max_seq_len``; a forward pass only gathers rows, so any positions ``[B, T]`` (a decode step at
position 517, a batch whose rows sit at different offsets) cost one index operation.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from llmlib.config import ModelConfig, RopeScaling

Layout = Literal["split_half", "interleaved"]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Angular speed of each of the ``head_dim/2`` pairs, in radians per position (float32).

    Pair ``i`` turns at ``theta ** (-2i / head_dim)``: the first pairs spin fast (fine position
    detail), the last ones slowly (coarse, long-range position).

    ``scaling`` applies Llama-3's recipe for long contexts: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are slowed by ``factor``; wavelengths
    shorter than ``original / high_freq_factor`` are left alone; in between, a smooth blend. So the
    fast pairs that encode local order keep their trained behaviour, and only the slow pairs are
    stretched to cover a longer context. ``scaling.rope_type == "linear"`` (Gemma 3) instead slows
    every pair by ``factor``: position ``p`` turns as position ``p / factor`` did.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unknown rope scaling type {scaling.rope_type!r} (llama3 or linear)")
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_angles(inv_freq: torch.Tensor, n_positions: int) -> torch.Tensor:
    """Angle of every pair at every position: ``[n_positions, head_dim/2]`` (float32)."""
    pos = torch.arange(n_positions, dtype=torch.float32, device=inv_freq.device)
    return torch.outer(pos, inv_freq)


class RotaryTables(nn.Module):
    """cos and sin of every (position, pair) angle, computed once and gathered per forward pass.

    The tables are stored already widened to ``head_dim`` in the split-half order
    (``[c0..c_{h/2-1}, c0..c_{h/2-1}]``) so applying RoPE is two multiplies and an add, with no
    per-layer recomputation. They are non-persistent buffers: they are derived from the config,
    never read from a checkpoint.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
    ):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = (
            head_dim,
            max_seq_len,
            theta,
            scaling,
        )
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, local: bool = False) -> RotaryTables:
        """The model's tables; ``local=True``: those of Gemma 3's sliding layers (their own base,
        no scaling)."""
        if local:
            if cfg.rope_local_theta is None:
                raise ValueError(f"{cfg.name}: no local RoPE base (rope_local_theta) in the config")
            return cls(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta, None)
        return cls(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        ang = rope_angles(rope_inv_freq(self.head_dim, self.theta, self.scaling), self.max_seq_len)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def reset(self, device: torch.device | str | None = None) -> None:
        """Recompute the float32 tables on ``device`` (default: where they are now), e.g. after the
        model was built on the ``meta`` device, where buffers hold no data."""
        if device is None:
            device = self.cos.device
        with torch.device("cpu"):
            cos, sin = self._tables()
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [B, T], shaped ``[B, 1, T, head_dim]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The split-half partner of every element, with the sign of a 90-degree turn: ``[-x2, x1]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate split-half pairs of ``x`` [..., T, head_dim] by the gathered angles (cos/sin as from
    :class:`RotaryTables`): ``(a, b) -> (a cos - b sin, a sin + b cos)`` for every pair."""
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation for the interleaved layout, pairs ``(x[2i], x[2i+1])``.

    Takes the same split-half-widened cos/sin tables (only their first half is needed).
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


def apply_rope_layout(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Layout = "split_half"
) -> torch.Tensor:
    """Dispatch on the layout name (``"split_half"`` or ``"interleaved"``)."""
    if layout == "split_half":
        return apply_rope(x, cos, sin)
    if layout == "interleaved":
        return apply_rope_interleaved(x, cos, sin)
    raise ValueError(f"unknown RoPE layout {layout!r} (expected 'split_half' or 'interleaved')")


def interleaved_to_split_half_perm(head_dim: int) -> torch.Tensor:
    """Index ``perm`` such that ``x_interleaved[..., perm]`` is in split-half order.

    Split-half slot ``i`` holds the first element of pair ``i`` (interleaved slot ``2i``) and slot
    ``i + h/2`` its second element (interleaved slot ``2i + 1``). Applied to the output rows of
    ``W_q``/``W_k`` of every head, it converts a checkpoint from one convention to the other.
    """
    half = head_dim // 2
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])[: 2 * half]


def permute_heads(w: torch.Tensor, n_heads: int, perm: torch.Tensor) -> torch.Tensor:
    """Apply a per-head row permutation to a projection weight ``[n_heads * head_dim, d_in]``."""
    hd = w.shape[0] // n_heads
    return w.view(n_heads, hd, *w.shape[1:])[:, perm].reshape(w.shape)
