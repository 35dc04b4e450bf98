"""bfloat16 matrices on a CPU without bfloat16 arithmetic: plain for decode, widened to float32
for prompts.

An AVX2-only CPU stores bfloat16 but has no instruction that multiplies it, so the format's one
gain there is bytes: half of float32's for every row that streams the matrix.
:func:`llmlib.kernels.prepare.pack_dense` holds each bfloat16 matrix of such a CPU (where the
flags say so: :attr:`~llmlib.kernels.flags.Flags.bfloat16_widen`) as a :class:`Bfloat16Weight`.
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
    """A bfloat16 matrix on a CPU that has no bfloat16 arithmetic (no AVX512-BF16, no AMX: an
    AVX2-only machine), and the product that suits each number of rows there.

    A row or two (decode) is limited by how fast the matrix streams from memory: PyTorch's own
    bfloat16 product reads it at half the bytes of float32, which is the point of the format.
    Many rows (a prompt, a batch) are limited by arithmetic, which such a CPU does in float32
    only. PyTorch's generic bfloat16 kernel then converts inside its inner loop and runs several
    times slower than the tuned float32 kernels. So from :data:`WIDEN_ROWS` rows on, a slice of
    the matrix at a time is widened to float32 and multiplied by those. Both ways sum in float32
    and round the result to bfloat16 once. A compiled graph multiplies the bfloat16 matrix
    itself, with its own kernels (:meth:`for_graph`). In a state dict this is the plain matrix.

    The widened product is not row-invariant, so the batch-invariant engine's view
    (:func:`llmlib.kernels.prepare.row_tiled`) multiplies the plain matrix instead. MKL's float32
    kernel for AVX2 computes the last two rows of a 32-row tile with other code, which sums in
    another order, so a token's result would depend on which row of its tile it landed in.
    PyTorch's bfloat16 kernel treats every row alike.
    """

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
