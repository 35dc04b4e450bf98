"""The layers :func:`llmlib.kernels.prepare.prepare` swaps into a model, with the contract of
the chapters' own and the product or lookup of a stored layout (:mod:`llmlib.kernels.weights`):
:class:`PackedLinear` for an ``nn.Linear``, :class:`PackedEmbedding` for a
:class:`llmlib.model.embedding.TokenEmbedding` whose table is stored in a layout (tied,
quantized, or float32 with the one-row kernel). Both keep the state-dict names they replace.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlib.kernels.stacked import StackedWeight
from llmlib.kernels.weights import PackedWeight
from llmlib.model.embedding import TokenEmbedding


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` a :class:`PackedWeight` (its own kernel)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class PackedEmbedding(TokenEmbedding):
    """The token table as a :class:`PackedWeight`: rows for lookup, its product for a tied head."""

    def __init__(self, weight: PackedWeight, scale: float | None = None) -> None:
        nn.Module.__init__(self)
        self.scale = scale
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.weight.rows(ids))

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(h)


def parameter_count(model: nn.Module) -> int:
    """How many weights ``model`` holds, a stored matrix counted by its shape, a tied table once."""
    packed = sum(
        m.shape.numel()
        for m in model.modules()
        if isinstance(m, PackedWeight) and not isinstance(m, StackedWeight)  # its parts count
    )
    return packed + sum(p.numel() for p in model.parameters())
