"""A big matrix read from a checkpoint a slice of rows at a time, and packed as it comes.

An embedding table or an LM head is a large share of a model (half a billion weights each in
Llama-3-8B). Read whole, it exists in floats (or codes) beside its stored layout, which on a small
machine is the difference between loading and not. :class:`Rows` reads slices; :func:`assemble`
stores each before reading the next, handing freed memory back between slices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmlib.kernels import integer
from llmlib.kernels.weights import PackedWeight
from llmlib.quantize import ChannelCodes, Codes, GroupCodes


@dataclass(frozen=True)
class Rows:
    """A matrix read in slices: ``read(i, j)`` returns rows ``i .. j-1``, floats or codes."""

    shape: tuple[int, int]
    read: Callable[[int, int], torch.Tensor | ChannelCodes | GroupCodes]
    chunk: int = 2048  # rows per read: a multiple of every kernel's tile

    def chunks(self):
        n = self.shape[0]
        for i in range(0, n, self.chunk):
            yield i, self.read(i, min(n, i + self.chunk))


class Filled:
    """A packed matrix assembled from its slices' packed layouts: each buffer allocated once, each
    slice copied in as it comes (every layout keeps its buffers row-major in tiles of output rows,
    so a slice of rows is a slice of each buffer)."""

    def __init__(self, rows: int) -> None:
        self.rows, self.buffers = rows, {}
        self.first: PackedWeight | None = None

    def add(self, i: int, part_rows: int, w: PackedWeight) -> None:
        if self.first is None:
            self.first = w
        for name, b in w.named_buffers(recurse=False):
            if b.dim() == 0 or b.shape[0] == 0:
                continue
            lo, hi = i * b.shape[0] // part_rows, (i + part_rows) * b.shape[0] // part_rows
            out = self.buffers.get(name)
            if out is None:  # zeros: rows of slices without this buffer (no offsets) read 0
                size = self.rows * b.shape[0] // part_rows
                out = torch.zeros((size, *b.shape[1:]), dtype=b.dtype, device=b.device)
            elif out.dtype != b.dtype:  # constants a slice cannot keep in float16: widen all
                if not (out.dtype.is_floating_point and b.dtype.is_floating_point):
                    raise RuntimeError(
                        f"{name}: slices of one matrix packed as {out.dtype} and {b.dtype}"
                    )
                out = out.to(torch.promote_types(out.dtype, b.dtype))
            self.buffers[name] = out
            out[lo:hi].copy_(b)

    def result(self) -> PackedWeight:
        w = self.first
        for name, out in self.buffers.items():
            setattr(w, name, out)
        w.shape = torch.Size((self.rows, w.shape[1]))
        if hasattr(w, "refresh"):  # what a layout derives from its buffers, for the whole matrix
            w.refresh()
        return w


def assemble(
    src: Rows,
    name: str,
    fmt: Any,
    quantize: Callable[[str, torch.Tensor], Codes] | None,
    slot: torch.Tensor | None,
):
    """A matrix read in slices: float rows copied into ``slot`` (or a new tensor), or quantized;
    codes packed slice by slice into the integer kernels' layout where it takes the whole matrix
    (else concatenated). Only one slice's floats or codes exist at a time."""
    out, codes, filled = slot, [], None
    for i, part in src.chunks():
        if isinstance(part, torch.Tensor) and quantize is not None:
            part = quantize(name, part)
        if isinstance(part, torch.Tensor):
            if out is None:
                out = torch.empty(src.shape, dtype=fmt.dtype, device=fmt.device)
            out[i : i + part.shape[0]].copy_(part)
        elif filled is not None or (not codes and _packs_whole(part, src.shape, fmt)):
            filled = filled or Filled(src.shape[0])
            filled.add(i, part.shape[0], integer.pack(part, fmt.dtype))
        else:
            codes.append(part)
        size = _float_bytes(part)
        del part
        if fmt.device.type == "cpu":  # a slice's temporaries, before the next slice's
            give_back_freed_memory(size)
    if filled is not None:
        return filled.result()
    if not codes:
        return out
    return codes[0] if len(codes) == 1 else type(codes[0]).cat(codes)


def _float_bytes(part: Any) -> int:
    """What a slice of rows takes in float32, the size of the temporaries it leaves behind."""
    return 4 * part.shape[0] * part.shape[-1]


def _packs_whole(part: Codes, shape: tuple[int, int], fmt: Any) -> bool:
    """Whether the integer kernels take the whole matrix ``part`` starts (slices: whole tiles)."""
    if fmt.device.type != "cpu" or not integer.available() or part.shape[0] % integer.TILE:
        return False
    if isinstance(part, ChannelCodes):
        return integer.fits(shape)
    return part.bits in (4, 6, 8) and integer.fits(shape, part.group_size, bits=part.bits)


#: bytes of matrices handled between two trims: a trim costs more than a small matrix's own
#: work (it walks the heap, and the pages it hands back fault in again on the next slice)
TRIM_EVERY = 16 << 20
_handled = 0


def give_back_freed_memory(nbytes: int | None = None) -> None:
    """Hand freed memory back to the system (glibc keeps freed blocks of a few MB, and many
    matrices' temporaries would add up to several times the model while it loads). ``nbytes``:
    what was just handled; the trim waits for :data:`TRIM_EVERY` bytes (None: trim now)."""
    global _handled
    if nbytes is not None:
        _handled += nbytes
        if _handled < TRIM_EVERY:
            return
    _handled = 0
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
