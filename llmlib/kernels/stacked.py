"""A matrix made of row blocks in different layouts: one product per block, side by side.

A fused projection (q/k/v) whose parts a GGUF file stores in different block types (a Q4_K_M
layer: q and k in Q4_K, v in Q6_K) would need the widest part's layout for all of it, and the
narrow parts would be read in more bytes than the file holds. Kept apart, each part is read in
its own (:func:`llmlib.kernels.prepare.pack_codes`).
"""

from __future__ import annotations

import torch
from torch import nn

from llmlib.kernels.weights import PackedWeight


class StackedWeight(PackedWeight):
    """Row blocks of one matrix, each in its own layout: a fused q/k/v whose parts a GGUF file
    stores in different block types (:class:`~llmlib.quantize.CodeParts`). Each block's product is
    its own kernel's, and the outputs sit side by side: every part is read in its own bytes,
    where one common layout would widen the narrow parts to the widest."""

    kind = "stacked"

    def __init__(self, parts: list[PackedWeight]) -> None:
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"StackedWeight: parts of different widths {sorted(widths)}")
        super().__init__((sum(p.shape[0] for p in parts), widths.pop()))
        self.parts = nn.ModuleList(parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def label(self) -> str:
        """Each part's layout once, in row order: ``int4 g32 vnni + int6 g16 vnni``."""
        return " + ".join(dict.fromkeys(p.label for p in self.parts))

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.linear(x) for p in self.parts], dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def for_graph(self) -> PackedWeight:
        new = [p.for_graph() for p in self.parts]
        if all(a is b for a, b in zip(new, self.parts, strict=True)):
            return self
        return StackedWeight(new)
