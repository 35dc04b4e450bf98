"""Batch-1 decode's float32 product, one row times a weight matrix, in C++ where MKL is slow.

A float32 decode step on a CPU is a matrix-vector product per weight matrix, and it can go no
faster than the matrix streams from memory (chapter 9's floor). PyTorch hands that product to
MKL, which chooses its code by CPU vendor: on AMD's CPUs its matrix-vector path streams the
weights at a fraction of the measured read bandwidth. The kernel here
(``llmlib/kernels/csrc/matvec.cpp``, op ``llmlib_matvec::matvec``) walks contiguous rows eight at
a time and sums each one in registers: nothing more than the product, streamed.

A float32 matrix takes it (:class:`llmlib.kernels.weights.Float32Weight` with ``one_row``) where
:func:`serves`: the flags choose it (:attr:`llmlib.kernels.flags.Flags.matvec`: on a CPU not
made by Intel, or ``LLMLIB_MATVEC=1``), it builds (AVX-512, or AVX2 with FMA, and a compiler),
and the matrix is contiguous with rows of a multiple of 16 values.
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
    """Whether :func:`matvec` takes this ``[out, in]`` matrix (float32, CPU, contiguous rows of a
    multiple of 16 values) on this machine."""
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
