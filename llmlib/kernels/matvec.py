"""Batch-1 decode's float32 product, one row times a weight matrix, in C++ where MKL is slow.

It can go no faster than the matrix streams from memory (chapter 9's floor), and MKL, which
picks its code by CPU vendor, streams it on AMD's CPUs at a fraction of the measured read
bandwidth. The kernel (``llmlib/kernels/csrc/matvec.cpp``, op ``llmlib_matvec::matvec``) walks
contiguous rows eight at a time and sums each in registers: the product, streamed. A float32
matrix takes it (:class:`llmlib.kernels.weights.Float32Weight` with ``one_row``) where
:func:`serves` (:attr:`llmlib.kernels.flags.Flags.matvec`; contiguous rows, a multiple of 16).
"""

from __future__ import annotations

import functools

import torch

from llmlib.kernels import native
from llmlib.kernels.flags import flags

_NAME = "llmlib_matvec"


@functools.cache
def _load(isa: str) -> bool:
    if not native.build(
        f"{_NAME}_{isa}", "matvec.cpp", native.flags_for(isa), "float32 matrix-vector kernel"
    ):
        return False

    @torch.library.register_fake("llmlib_matvec::matvec")
    def _(x, w):
        return w.new_empty(w.shape[0])

    return True


def available() -> bool:
    """Whether the flags choose the kernel here and it builds (on the first call that asks)."""
    return flags().matvec and native.has_avx2() and _load(native.isa())


def serves(weight: torch.Tensor) -> bool:
    """Whether :func:`matvec` takes ``weight``: float32, CPU, contiguous, rows a multiple of 16."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 16 == 0
        and weight.is_contiguous()
        and available()
    )


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x [..., in]`` (every leading size 1) -> ``[..., out]``."""
    y = torch.ops.llmlib_matvec.matvec(x, weight)
    return y.view(*x.shape[:-1], weight.shape[0])
