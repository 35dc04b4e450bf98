"""RMSNorm: rescale each vector to unit root-mean-square, then a learned gain per channel.

It lives in its own module because two layers use it: the block normalises the residual stream
before each sub-layer (:mod:`llmlib.model.block`), and some families' attention normalises each
head's queries and keys (Qwen3, Gemma 3: :mod:`llmlib.model.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 whatever the model's dtype.

    Unlike LayerNorm there is no mean subtraction and no bias: cheaper, and it works as well.
    The float32 detour matters in bfloat16, where the sum of squares would otherwise lose bits.

    ``offset=1.0`` is Gemma's variant: the gain is ``1 + weight`` (so a checkpoint stores zeros for
    "no change"), and the product is taken in float32 before rounding back to the model's dtype.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        offset: float = 0.0,
    ):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # Gemma: scale by (1 + w) in float32, then round once
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 or x.dtype == self.weight.dtype:
            # PyTorch's own: in bfloat16 it sums in float32 too, and applies the gain before
            # rounding back, not after
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
