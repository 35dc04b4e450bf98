"""bfloat16 weights in oneDNN's blocked layout, held once.

On a CPU with AMX or AVX512-BF16, oneDNN multiplies a bfloat16 matrix several times faster once
re-ordered into its blocked layout, at one row and at many: :func:`llmlib.kernels.prepare.prepare`
stores each bfloat16 matrix of a CPU model so (:class:`OneDNNWeight`).
"""

from __future__ import annotations

import functools

import torch

from llmlib.kernels.flags import flags
from llmlib.kernels.weights import PackedWeight, PlainWeight


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``dtype`` matrices are held in oneDNN's layout here: the flags ask for it
    (:attr:`~llmlib.kernels.flags.Flags.onednn_bfloat16`, ``onednn_float32``), :func:`supported`."""
    f = flags()
    wanted = f.onednn_float32 if dtype == torch.float32 else f.onednn_bfloat16
    return wanted and supported(dtype)


@functools.cache
def supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this PyTorch and CPU re-order ``dtype`` for oneDNN (it refuses bfloat16 without
    AVX512-BW/VL/DQ or AVX-NE-CONVERT): probed once on a small matrix, so PyTorch's own answer."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class OneDNNWeight(PackedWeight):
    """A bfloat16 (or float32) matrix held only in oneDNN's blocked layout (what ``torch.compile``
    makes of frozen CPU weights): the same numbers, re-ordered once. A compiled graph multiplies
    the plain matrix instead (:meth:`for_graph`): the blocked tensor is opaque (no strides, no
    storage), so it cannot be a traced input; frozen, inductor re-stores the plain one itself."""

    _constants = "w"

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__(tuple(w.shape))
        self.register_buffer("w", torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"{str(self.w.dtype).removeprefix('torch.')} (oneDNN blocked)"

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.w.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.w, bias, "none", [], "")

    def for_graph(self) -> PackedWeight:
        return PlainWeight(self.w.to_dense())

    def dequantize(self) -> torch.Tensor:
        return self.w.to_dense()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # the plain matrix, under the weight's name (``...wqkv.weight``, split into wq, wk, wv)
        destination[prefix.removesuffix(".")] = self.w.to_dense()
