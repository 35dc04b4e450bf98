"""Weight-matrix products, and a second copy of the weights that batches multiply faster on a CPU.

Every product of activations with a weight matrix in the model goes through :func:`linear`. On a
GPU, and for anything that is not a float32 matrix on the CPU, it is ``F.linear``. On the CPU two
kinds of product matter, and no single memory layout serves both:

* one token at a time (batch-1 decode): a matrix-vector product, limited by how fast the weights
  stream from memory. The layout chosen by :func:`llmlib.loading.use_matvec_layout` is best.
* many tokens at once (a prefill, or a batch of decoding sequences): a matrix-matrix product,
  limited by arithmetic. oneDNN, PyTorch's CPU deep-learning library, multiplies fastest when the
  weight is first re-ordered into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
  what ``torch.compile`` does to frozen CPU weights). Measured on this project's 2-core machine:
  a [55, 576] x [576, 3072] product runs at ~220 GFLOP/s against ~140 through ``F.linear``, the
  LM head at ~200 against ~95, and at 2-8 rows the gap is 2-3x.

:func:`pack_weights` adds the blocked copy to every weight matrix (the dense matrix stays: state
dicts, plots and the batch-1 path read it), so a float32 CPU model then holds its weights twice.
:func:`linear` takes the packed copy when the input has more than one row. The copy remembers
which tensor it was made from and that tensor's version counter: if the weight is replaced or
changed in place afterwards, the stale copy is ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_llmlib_packed"  # (packed weight, source data_ptr, source version), set on the Parameter


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., in]`` and ``weight [out, in]``: the packed copy when it is valid
    and ``x`` holds more than one row, else ``F.linear``."""
    packed = getattr(weight, _ATTR, None)
    if packed is not None and x.numel() > x.shape[-1] and x.dtype == torch.float32:
        p, ptr, version = packed
        if ptr == weight.data_ptr() and version == weight._version:
            return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    return F.linear(x, weight)


def pack_weights(model: nn.Module) -> int:
    """Give every float32 CPU weight matrix of ``model`` a oneDNN-packed copy; return how many.

    A no-op (returns 0) on other devices and dtypes, or where PyTorch was built without oneDNN.
    Calling it again re-packs only matrices whose copy went stale.
    """
    if not _packing_available():
        return 0
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() != 2 or p.device.type != "cpu" or p.dtype != torch.float32:
                continue
            old = getattr(p, _ATTR, None)
            if old is not None and old[1] == p.data_ptr() and old[2] == p._version:
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(p.data.contiguous(), None)
            setattr(p, _ATTR, (packed, p.data_ptr(), p._version))
            n += 1
    return n


def is_packed(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` would use a packed copy of ``weight`` for a multi-row input."""
    packed = getattr(weight, _ATTR, None)
    return packed is not None and packed[1] == weight.data_ptr() and packed[2] == weight._version
