"""Where a CPU model's float matrices live in memory: the layout decode streams fastest.

A decode step can go no faster than the matrices stream from memory, and their layout changes
that: which dimension is contiguous (:func:`matvec_layout_is_column_major`), and whether their
pages are 4 KiB or 2 MiB (:func:`arrange`). :func:`llmlib.kernels.prepare.prepare` applies it.
"""

from __future__ import annotations

import ctypes
import sys

import torch


def matvec_layout_is_column_major(
    shape: torch.Size | tuple[int, ...], one_row_kernel: bool = False
) -> bool:
    """Whether a ``[out, in]`` weight multiplies one vector faster stored column-major on a CPU.
    MKL streams long contiguous runs best: on the machines this book was written on, gate/up and
    the LM head streamed faster column-major, the down projection row-major. So the longer
    dimension is contiguous (ties: column-major, slightly faster for wo); llmlib's one-row
    kernel (``one_row_kernel``, :mod:`llmlib.kernels.matvec`) streams row-major."""
    if one_row_kernel:
        return False
    out_features, in_features = shape
    return out_features >= in_features


_HUGE_PAGE = 2 << 20  # bytes in an x86-64 transparent huge page


def _advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask Linux to back ``[ptr, ptr + nbytes)`` (2 MiB aligned, untouched) with huge pages."""
    if not sys.platform.startswith("linux") or nbytes < _HUGE_PAGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ptr, nbytes, 14) == 0  # 14 = MADV_HUGEPAGE
    except (OSError, AttributeError):
        return False


def slots(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    *,
    one_row_kernel: bool = False,
    huge_pages: bool = True,
) -> list[torch.Tensor]:
    """Empty CPU matrices of these shapes, laid out for fast decoding, in the order given: each
    in its faster layout (:func:`matvec_layout_is_column_major`), all in one buffer in the order
    a forward pass reads them, which Linux is asked to back with 2 MiB pages
    (``madvise(MADV_HUGEPAGE)``): a step touches every weight once, one TLB miss per 4 KiB page,
    or per 2 MiB with huge pages. Nothing is written: pages come as each matrix is copied in,
    so a loader can fill them one at a time straight from the checkpoint."""
    if not shapes:
        return []
    elt = torch.empty((), dtype=dtype).element_size()
    step = 64 // elt  # start every matrix on a cache line
    sizes = [-(-(n * k) // step) * step for n, k in shapes]
    total = sum(sizes)
    pad = _HUGE_PAGE // elt
    arena = torch.empty(total + pad, dtype=dtype)  # untouched memory: pages come on first write
    ptr = arena.data_ptr()
    aligned = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    if huge_pages:
        _advise_huge_pages(aligned, (total * elt) // _HUGE_PAGE * _HUGE_PAGE)
    offset = (aligned - ptr) // elt
    out = []
    for (n, k), size in zip(shapes, sizes):
        chunk = arena[offset : offset + n * k]
        column_major = matvec_layout_is_column_major((n, k), one_row_kernel)
        out.append(chunk.view(k, n).t() if column_major else chunk.view(n, k))
        offset += size
    return out


def arrange(mats: list[torch.Tensor], *, one_row_kernel: bool = False) -> list[torch.Tensor]:
    """The same CPU matrices (one dtype) copied into :func:`slots`."""
    if not mats:
        return []
    if len({m.dtype for m in mats}) != 1 or any(m.device.type != "cpu" for m in mats):
        raise ValueError("arrange: CPU matrices of one dtype")
    out = slots([tuple(m.shape) for m in mats], mats[0].dtype, one_row_kernel=one_row_kernel)
    with torch.no_grad():
        for new, m in zip(out, mats):
            new.copy_(m)
    return out
