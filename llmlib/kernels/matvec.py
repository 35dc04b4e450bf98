"""Batch-1 decode's float32 product, one row times a weight matrix, in C++ where MKL is slow.

A float32 decode step on a CPU is a matrix-vector product per weight matrix, and it can go no
faster than the matrix streams from memory (chapter 9's floor). PyTorch hands that product to
MKL, which chooses its code by CPU vendor: on AMD's CPUs its matrix-vector path streams the
weights at a fraction of the measured read bandwidth. The kernel here
(``llmlib/kernels/csrc/matvec.cpp``, op ``llmlib_matvec::matvec``) walks contiguous rows eight at a time
and sums each one in registers: nothing more than the product, streamed.

:func:`llmlib.kernels.linear.linear` takes it for a one-row float32 product on the CPU where it serves:
AVX-512 or AVX2 with FMA, a compiler, a contiguous matrix whose rows hold a multiple of 16
values, and :func:`preferred` (a CPU not made by Intel, where MKL tunes its own paths; or
``LLMLIB_MATVEC=1``; ``LLMLIB_MATVEC=0`` turns it off everywhere). Elsewhere MKL serves, and
:func:`llmlib.kernels.linear.use_matvec_layout` stores each matrix in the layout MKL streams fastest.
"""

from __future__ import annotations

import functools
import os

import torch

from llmlib.kernels import native

_NAME = "llmlib_matvec"


@functools.cache
def _load(isa: str) -> bool:
    flags = native.AVX512 if isa == "avx512" else native.AVX2
    if not native.build(f"{_NAME}_{isa}", "matvec.cpp", flags, "float32 matrix-vector kernel"):
        return False

    @torch.library.register_fake("llmlib_matvec::matvec")
    def _(x, w):
        return w.new_empty(w.shape[0])

    return True


_answer: list[bool] = []  # the kept answer, once known


def preferred() -> bool:
    """Whether one-row float32 products run here instead of MKL's (``LLMLIB_MATVEC`` forces it:
    ``1`` on, ``0`` off; unset: on a CPU not made by Intel). Builds it on the first call.

    :func:`llmlib.kernels.linear.linear` asks on every one-row product, and reading the environment
    costs more than the rest of the check, so the answer is kept from the first call on
    (``preferred.cache_clear()`` makes the next call read the variables again). A compiled
    graph that asks after the first call reads a module global, which dynamo folds into a
    constant; :func:`llmlib.runtime.compile.compile_decode` asks once before compiling, so dynamo never
    traces the /proc/cpuinfo read (a graph break). Not ``torch.compiler.assume_constant_result``:
    that decorator imports dynamo with this module, and so into every process that loads one."""
    if not _answer:
        _answer.append(_preferred())
    return _answer[0]


def _preferred() -> bool:
    from llmlib.device import mkl_tuned

    forced = os.environ.get("LLMLIB_MATVEC")
    if forced == "0" or not (forced == "1" or not mkl_tuned()):
        return False
    if native.has_avx512():
        return _load("avx512")
    return native.has_avx2() and _load("avx2")


preferred.cache_clear = _answer.clear  # type: ignore[attr-defined]


def serves(weight: torch.Tensor) -> bool:
    """Whether :func:`matvec` takes this ``[out, in]`` matrix (float32, CPU, contiguous rows of a
    multiple of 16 values) on this machine."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 16 == 0
        and weight.is_contiguous()
        and preferred()
    )


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x [..., in]`` (every leading size 1) -> ``[..., out]``."""
    y = torch.ops.llmlib_matvec.matvec(x, weight)
    return y.view(*x.shape[:-1], weight.shape[0])
