"""Weight-matrix products, and a second copy of the weights that batches multiply faster on a CPU.

Every product of activations with a weight matrix in the model goes through :func:`linear`. On a
GPU, and for anything that is not a float32 matrix on the CPU, it is ``F.linear``. On the CPU two
kinds of product matter, and no single memory layout serves both:

* one token at a time (batch-1 decode): a matrix-vector product, limited by how fast the weights
  stream from memory. The layout chosen by :func:`use_matvec_layout` is best.
* many tokens at once (a prefill, or a batch of decoding sequences): a matrix-matrix product,
  limited by arithmetic. oneDNN, PyTorch's CPU deep-learning library, multiplies fastest when the
  weight is first re-ordered into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
  what ``torch.compile`` does to frozen CPU weights); chapter 10 measures by how much.

:func:`pack_weights` adds the blocked copy to every weight matrix (the dense matrix stays: state
dicts, plots and the batch-1 path read it), so a float32 CPU model then holds its weights twice;
the loader does not do it by default (:func:`prepare_cpu_weights` says why).
:func:`linear` takes the packed copy when the input has more than one row. The copy remembers
which tensor it was made from and that tensor's version counter: if the weight is replaced or
changed in place afterwards, the stale copy is ignored.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmlib.kernels import matvec

_ATTR = "_llmlib_packed"  # (packed weight, source data_ptr, source version), set on the Parameter
#: rows per product in batch-invariant mode (:func:`fixed_row_tiles`); None: one product for all
_ROW_TILE: ContextVar[int | None] = ContextVar("llmlib_row_tile", default=None)


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [..., in]`` and ``weight [out, in]``; ``bias [out]`` is
    optional (Qwen2's q, k, v projections have one).

    ``weight`` is a dense tensor, or a quantized one stored for a weight-only kernel
    (:class:`llmlib.quantize.PackedWeight`, which brings its own product). A dense float32 matrix
    with a valid oneDNN copy (:func:`pack_weights`) uses it when ``x`` holds more than one row.
    Inside :func:`fixed_row_tiles` every product is taken over a fixed number of rows.
    """
    # dynamo cannot trace ContextVar.get (a graph break at every product): a compiled graph is
    # never batch-invariant, so it skips the lookup
    tile = None if torch.compiler.is_compiling() else _ROW_TILE.get()
    if tile is not None:
        return _tiled_linear(x, weight, bias, tile)
    return _linear(x, weight, bias)


@contextlib.contextmanager
def fixed_row_tiles(tile: int = 32) -> Iterator[None]:
    """Within this block, :func:`linear` multiplies ``tile`` rows at a time, padding the last
    tile with zero rows, so every product the kernel library sees has the same shape.

    Why: BLAS and oneDNN pick their kernel, and with it the order of each dot product's sum,
    from the matrix shapes, the number of rows included (one row takes a matrix-vector path;
    bfloat16 products switch kernels past 32 rows). A token's result then depends on how many
    other tokens share its step. With the row count fixed it cannot: row ``i`` of a product
    depends only on row ``i`` of the input (``tests/test_batch_invariant.py`` checks it). The
    batch-invariant engine (``LLM(..., batch_invariant=True)``) runs every step inside this.
    """
    if not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"fixed_row_tiles: tile must be a positive integer, got {tile!r}")
    token = _ROW_TILE.set(tile)
    try:
        yield
    finally:
        _ROW_TILE.reset(token)


def _tiled_linear(
    x: torch.Tensor, weight: Any, bias: torch.Tensor | None, tile: int
) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    padded = rows.new_zeros(-(-n // tile) * tile, k)
    padded[:n] = rows
    out = torch.cat(
        [_linear(padded[i : i + tile], weight, bias) for i in range(0, len(padded), tile)]
    )
    return out[:n].view(*lead, out.shape[-1])


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if x.numel() == x.shape[-1] and x.dtype == torch.float32 and matvec.serves(weight):
        y = matvec.matvec(x, weight)  # one row: where MKL streams slowly (llmlib.kernels.matvec)
        return y if bias is None else y + bias
    packed = getattr(weight, _ATTR, None)
    if packed is not None and x.numel() > x.shape[-1] and x.dtype == torch.float32:
        p, ptr, version = packed
        if ptr == weight.data_ptr() and version == weight._version:
            return torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], "")
    return F.linear(x, weight, bias)


def embedding_rows(ids: torch.Tensor, weight: Any) -> torch.Tensor:
    """``weight[ids]``: the embedding lookup, from a dense table or a quantized (tied) one."""
    if not isinstance(weight, torch.Tensor):
        return weight.rows(ids)
    return F.embedding(ids, weight)


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


def unpack_weights(model: nn.Module) -> int:
    """Drop every oneDNN copy :func:`pack_weights` made (the model then holds its weights once);
    return how many. ``llmlib bench batching`` times the engine both ways in one run."""
    n = 0
    for p in model.parameters():
        if getattr(p, _ATTR, None) is not None:
            delattr(p, _ATTR)
            n += 1
    return n


def is_packed(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` would use a packed copy of ``weight`` for a multi-row input."""
    packed = getattr(weight, _ATTR, None)
    return packed is not None and packed[1] == weight.data_ptr() and packed[2] == weight._version


def onednn_float32_preferred() -> bool:
    """Whether a CPU float32 model keeps oneDNN's blocked copy of each matrix for products of
    several rows (:func:`pack_weights`): on a CPU that is not Intel's. MKL, which PyTorch calls
    for plain float32 products, picks its kernels by vendor, and on other CPUs (AMD's among them)
    takes generic paths that multiply a few rows several times slower than one (chapter 8's
    verification cost shows it); oneDNN's own kernels do not. One row (batch-1 decode) keeps
    the plain matrix, which streams faster. ``LLMLIB_ONEDNN_FLOAT32=1``/``0`` forces it."""
    from llmlib.device import mkl_tuned
    from llmlib.kernels.onednn import available

    forced = os.environ.get("LLMLIB_ONEDNN_FLOAT32")
    wanted = forced != "0" if forced in ("0", "1") else not mkl_tuned()
    return wanted and available(torch.float32)


def prepare_cpu_weights(model: nn.Module) -> None:
    """Store a CPU model's matrices for the products it runs; a no-op on another device.

    float32: the decode layout (:func:`use_matvec_layout`), one copy. The oneDNN-blocked second
    copy (:func:`pack_weights`) is made only where MKL is slow at several rows
    (:func:`onednn_float32_preferred`): on an Intel CPU, measured over the whole engine
    (``llmlib bench batching`` runs it both ways), it did not repay the memory. A bfloat16 model
    holds its matrices once, in oneDNN's layout only (:func:`pack_bfloat16`), which serves both.
    """
    mats = [p for p in model.parameters() if p.dim() == 2]
    if not mats or any(p.device.type != "cpu" for p in mats):
        return
    if all(p.dtype == torch.bfloat16 for p in mats) and pack_bfloat16(model):
        return
    use_matvec_layout(model)  # batch-1 decode: matrix-vector products stream these
    if all(p.dtype == torch.float32 for p in mats) and onednn_float32_preferred():
        pack_weights(model)  # products of several rows: where MKL is slow, oneDNN's copy


def pack_bfloat16(model: nn.Module) -> int:
    """Hold every bfloat16 weight matrix of a CPU model only in oneDNN's blocked layout
    (:class:`llmlib.kernels.onednn.OneDNNWeight`): one copy, and AMX multiplies it at one row as well
    as at many. A tied embedding table stays a plain matrix, since the lookup reads its rows.
    Where oneDNN has no bfloat16 path on this CPU (AVX2 only), nothing changes and 0 comes back:
    the matrices stay plain bfloat16 tensors."""
    return pack_onednn(model, torch.bfloat16)


def pack_onednn(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold every ``dtype`` weight matrix of a CPU model only in oneDNN's blocked layout (see
    :func:`pack_bfloat16`); how many were re-stored, 0 where oneDNN cannot here."""
    from llmlib.kernels.onednn import OneDNNWeight, available
    from llmlib.quantize import weight_matrices

    if not available(dtype):
        return 0
    n = 0
    for name, mod in weight_matrices(model).items():
        w = mod.weight
        if name == "embed" or not isinstance(w, torch.Tensor) or w.dtype != dtype:
            continue
        del mod.weight
        mod.weight = OneDNNWeight(w.data.contiguous())
        n += 1
    return n


# ---- the decode layout --------------------------------------------------------------------------


def matvec_layout_is_column_major(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a ``[out, in]`` weight multiplies one vector faster stored column-major on a CPU.

    A decode step is a matrix-vector product per weight, limited by how fast the weights stream from
    memory. MKL streams long contiguous runs best, and which dimension is the long run matters:
    on the machines this book was written on, gate/up and the LM head streamed faster column-major
    and the down projection row-major.
    So: make the longer dimension the contiguous one (ties: column-major, slightly faster for wo).
    Where llmlib's own kernel takes one-row products instead (:mod:`llmlib.kernels.matvec`), every
    matrix stays row-major, the layout it streams.
    """
    if matvec.preferred():
        return False
    out_features, in_features = shape
    return out_features >= in_features


def _in_matvec_layout(p: torch.Tensor) -> bool:
    if matvec_layout_is_column_major(p.shape):
        return p.stride() == (1, p.shape[0])
    return p.is_contiguous()


_HUGE_PAGE = 2 << 20  # bytes in an x86-64 transparent huge page


def _advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask Linux to back ``[ptr, ptr + nbytes)`` (2 MiB aligned, not yet touched) with huge pages."""
    if not sys.platform.startswith("linux") or nbytes < _HUGE_PAGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ptr, nbytes, 14) == 0  # 14 = MADV_HUGEPAGE
    except (OSError, AttributeError):
        return False


def use_matvec_layout(model: torch.nn.Module, huge_pages: bool = True) -> int:
    """Re-store the weight matrices for fast decoding on a CPU; return how many were moved.

    Two things make a batch-1 decode step (one matrix-vector product per weight, limited by how
    fast the weights stream from memory) faster, with the same names, shapes and values:

    * each matrix gets its faster layout (:func:`matvec_layout_is_column_major`);
    * all matrices move into one buffer, in the order a forward pass reads them, that Linux is
      asked to back with 2 MiB pages instead of 4 KiB ones (``madvise(MADV_HUGEPAGE)``): a step
      touches every weight once, i.e. one small page (and one TLB miss) per 4 KiB; with huge
      pages, one per 2 MiB.

    ``state_dict()`` still hands out contiguous tensors that own their memory
    (:class:`llmlib.model.Transformer` copies the others), so saving with safetensors works.
    A second call returns 0. Weights that are not on the CPU only get their layout changed.
    """
    mats = [p for p in model.parameters() if p.dim() == 2]
    if not mats:
        return 0
    dtypes = {p.dtype for p in mats}
    on_cpu = all(p.device.type == "cpu" for p in mats)
    # done already: every layout right and, where one buffer can hold them all, in one buffer
    # (a layout that needs no change, as for llmlib.kernels.matvec, still gets the huge pages, once)
    one = on_cpu and len(dtypes) == 1
    if all(_in_matvec_layout(p) for p in mats) and (not one or _shares_storage(mats)):
        return 0
    with torch.no_grad():
        if not one:
            for p in mats:
                if not _in_matvec_layout(p):
                    p.data = (
                        p.data.t().contiguous().t()
                        if matvec_layout_is_column_major(p.shape)
                        else p.data.contiguous()
                    )
            return len(mats)
        dtype = mats[0].dtype
        elt = torch.empty((), dtype=dtype).element_size()
        step = 64 // elt  # start every matrix on a cache line
        sizes = [-(-p.numel() // step) * step for p in mats]
        total = sum(sizes)
        pad = _HUGE_PAGE // elt
        # untouched memory: pages are allocated on first write
        arena = torch.empty(total + pad, dtype=dtype)
        ptr = arena.data_ptr()
        aligned = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
        if huge_pages:
            _advise_huge_pages(aligned, (total * elt) // _HUGE_PAGE * _HUGE_PAGE)
        offset = (aligned - ptr) // elt
        for p, size in zip(mats, sizes):
            out_f, in_f = p.shape
            chunk = arena[offset : offset + p.numel()]
            new = (
                chunk.view(in_f, out_f).t()
                if matvec_layout_is_column_major(p.shape)
                else chunk.view(out_f, in_f)
            )
            new.copy_(p.data)
            p.data = new
            offset += size
    return len(mats)


def _shares_storage(mats: list[torch.Tensor]) -> bool:
    base = mats[0].untyped_storage().data_ptr()
    return all(p.untyped_storage().data_ptr() == base for p in mats)
