"""bfloat16 matrices on a CPU without bfloat16 arithmetic: plain for decode, widened to float32
for prompts (:func:`llmlib.kernels.prepare.pack_dense`, where
:attr:`~llmlib.kernels.flags.Flags.bfloat16_widen`). An AVX2-only CPU cannot multiply bfloat16,
so the format's one gain there is bytes: half of float32's for every row that streams the matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlib.kernels.weights import PackedWeight, PlainWeight

#: From how many rows a :class:`Bfloat16Weight` widens its matrix to float32 for the product.
WIDEN_ROWS = 8
#: How many weights of the matrix are widened at a time (4 MiB of float32: the slice is read
#: back while it is still in cache, and a big table never has a float32 copy made whole).
WIDEN_SLICE = 1 << 20


class Bfloat16Weight(PlainWeight):
    """A bfloat16 matrix on a CPU without bfloat16 arithmetic (no AVX512-BF16, no AMX). Decode
    is bound by memory: PyTorch's bfloat16 product reads half of float32's bytes. Many rows are
    bound by arithmetic, done in float32 only, where PyTorch's generic bfloat16 kernel, converting
    in its inner loop, runs several times slower: from :data:`WIDEN_ROWS` rows on, slices of the
    matrix are widened to float32. Both sum in float32 and round once. A compiled graph, and
    :func:`llmlib.kernels.prepare.row_tiled` (MKL's float32 kernel for AVX2 takes the last two
    rows of a 32-row tile with other code), multiply the plain matrix (:meth:`for_graph`)."""

    kind = "bfloat16 (widened for several rows)"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        few_rows = x.numel() < WIDEN_ROWS * x.shape[-1]
        if few_rows or x.dtype != self.w.dtype:
            return F.linear(x, self.w, bias)  # PyTorch's bfloat16 product
        return PackedWeight.linear(self, x, bias)  # rows of x through _mm, then the bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        step = max(1, WIDEN_SLICE // self.shape[1])  # rows of the matrix per slice
        parts = []
        for i in range(0, self.shape[0], step):
            wide = self.w[i : i + step].float()  # this slice of the matrix, in float32
            parts.append(F.linear(xf, wide))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        return out.to(x.dtype)

    def for_graph(self) -> PackedWeight:
        return PlainWeight(self.w)
