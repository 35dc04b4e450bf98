"""How a weight matrix is stored for the kernel that multiplies it: one class per layout.

On a CPU the fastest product depends on the layout the weights are kept in, and each layout
comes with its own kernel, so the two travel together: a :class:`PackedWeight` is a module
holding the stored tensors, with ``linear(x, bias)``, ``rows(ids)`` (a tied table's lookup) and
``dequantize()``. :func:`llmlib.kernels.prepare.prepare` picks one per matrix, once, at load;
a :class:`llmlib.kernels.modules.PackedLinear` holds it. The layouts:

* :class:`Float32Weight` — float32 on a CPU: the one-row kernel, an optional oneDNN copy;
* :class:`llmlib.kernels.onednn.OneDNNWeight` — bfloat16 (or float32) in oneDNN's blocked layout;
* :class:`llmlib.kernels.bfloat16.Bfloat16Weight` — bfloat16 without bfloat16 arithmetic;
* :class:`Int8Weight`, :class:`Int4Weight` — PyTorch's weight-only kernels, on CPUs and GPUs:
  the reference the faster kernels are checked with;
* :mod:`llmlib.kernels.integer` — the same codes by integer dot products (VNNI or AVX2);
* :class:`RowTiles` — any of them, a fixed number of rows at a time (batch-invariant, chapter 7);
* :class:`PlainWeight` — a plain matrix and ``F.linear``: what a compiled graph multiplies where
  a layout is opaque to it (:meth:`PackedWeight.for_graph`,
  :func:`llmlib.runtime.compile.graph_view`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmlib.device import int4_refused
from llmlib.quantize import ChannelCodes, Codes, GroupCodes, check_group_size


class PackedWeight(nn.Module):
    """A weight matrix ``[out, in]`` stored for a weight-only kernel (a module: its buffers move
    with ``.to()``, show up in ``state_dict`` and are counted like any other tensor)."""

    kind = "packed"
    _constants = "scale"  # the buffer of float constants: its dtype is the activations'

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, in and out of the product (``.to()`` moves the constants)."""
        return getattr(self, self._constants).dtype

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` for ``x [..., in]`` in :attr:`dtype`."""
        lead = x.shape[:-1]
        y = self._mm(x.reshape(-1, x.shape[-1])).view(*lead, self.shape[0])
        return y if bias is None else y + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``w[ids]`` dequantized: the embedding lookup when the table is this matrix (tied)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.device))

    @property
    def label(self) -> str:
        """What the timing line calls this layout (``int8``, ``int4 g32``, ...)."""
        return self.kind

    def for_graph(self) -> PackedWeight:
        """What a compiled graph multiplies in this one's place (tensors shared): itself, or the
        plain matrix where the layout is opaque to the compiler or picks code at run time."""
        return self

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={tuple(self.shape)}, dtype={self.dtype}"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# PyTorch's CPU int8 kernel with bfloat16 activations reads past the end of a row whose width is
# not a multiple of 16: wrong products, or a crash (the families' odd test widths). Such matrices
# get zero columns up to the next multiple whatever the dtype (a later ``.to(bfloat16)``), and
# each input as many zeros: the same products. Real models' widths pay nothing.
_INT8_BF16_WIDTH = 16


class Int8Weight(PackedWeight):
    """int8 codes ``[out, in]`` and per-row scales: ``_weight_int8pack_mm(x, q, scales)``."""

    kind = "int8"

    def __init__(self, codes: ChannelCodes, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(codes.shape)
        q = codes.q.to(device=device, dtype=torch.int8)
        k = q.shape[1]
        self.pad = -k % _INT8_BF16_WIDTH
        if self.pad:
            q = torch.nn.functional.pad(q, (0, self.pad))
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", codes.scale.to(device=device, dtype=dtype).contiguous())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = torch.nn.functional.pad(x, (0, self.pad))
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids][..., : self.shape[1]]
        return q.to(self.dtype) * self.scale[ids, None]

    def to_codes(self) -> ChannelCodes:
        """The codes and scales this was packed from (another kernel's layout starts there)."""
        return ChannelCodes(self.q[:, : self.shape[1]], self.scale.float())


# PyTorch's CPU int4 layout packs output channels in blocks of B (64 for ATen's AVX-512 build, 32
# for AVX2). For each input column a block holds B/2 bytes; channel n sits in lane (n % B) // 16,
# byte (lane % (B // 32)) * 16 + n % 16, low nibble for the first half of the lanes. A tied
# table's lookup needs this map; Int4Weight checks it at pack time and keeps the plain codes
# where the kernel packed differently (another CPU, another version).
_CPU_BLOCKS_N = (64, 32)


def _cpu_int4_unpack_rows(
    packed: torch.Tensor, n: int, k: int, ids: torch.Tensor, block: int = 64
) -> torch.Tensor:
    """Codes ``[len(ids), k]`` of rows ``ids`` packed for the CPU in ``block``-row blocks."""
    per = block // 32  # 16-byte halves per column
    blocks = packed.view(n // block, k, block // 2)
    lane = (ids % block) // 16
    byte = (lane % per) * 16 + ids % 16
    raw = blocks[ids // block, :, :].gather(2, byte.view(-1, 1, 1).expand(-1, k, 1))
    raw = raw.squeeze(2)
    return torch.where((lane // per).view(-1, 1).bool(), raw >> 4, raw & 0x0F)


class Int4Weight(PackedWeight):
    """4-bit codes in a kernel's packed layout, and ``[in/g, out, 2]`` scales and zero points."""

    kind = "int4"
    _constants = "scale_zero"

    def __init__(self, codes: GroupCodes, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(codes.shape)
        n, k = codes.shape
        self.group_size = g = codes.group_size
        check_group_size(g, k, "int4 weight")
        sz = torch.stack([codes.scale, codes.zero], dim=2).transpose(0, 1)  # [K/g, N, 2]
        self.register_buffer("scale_zero", sz.to(device=device, dtype=dtype).contiguous())
        q = codes.q.to(device)
        self.on_cuda = torch.device(device).type == "cuda"
        self._readable = False
        self._block = 0  # channels per block of the CPU packed layout, 0 where unknown
        self.register_buffer("codes", None)  # plain codes, kept only where rows() needs them
        if self.on_cuda:
            why = int4_refused(torch.cuda.get_device_capability(device))
            if why is not None:
                raise ValueError(f"int4 weights: {why}; int8 or bfloat16 run there")
            u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack(u8, _inner_k_tiles(k))
            self.register_buffer("packed", packed)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.register_buffer("packed", packed)
            if packed.numel() * 2 == n * k:
                probe = torch.arange(0, n, max(1, n // 97), device=q.device)
                for b in _CPU_BLOCKS_N:
                    if n % b == 0 and torch.equal(
                        _cpu_int4_unpack_rows(packed, n, k, probe, b), q[probe]
                    ):
                        self._block = b
                        break
            self._readable = self._block > 0

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(
                x, self.packed, self.group_size, self.scale_zero
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scale_zero
        )

    def keep_codes_for_rows(self, codes: GroupCodes) -> None:
        """Where the packed layout cannot be read back row by row, keep the plain codes (one
        byte pair per two weights more) so :meth:`rows` still works: only a tied table needs it."""
        if self.on_cuda or not self._readable:
            q = codes.q.to(self.packed.device)
            self.register_buffer("codes", (q[:, ::2] | q[:, 1::2] << 4).to(torch.uint8))

    @property
    def label(self) -> str:
        return f"int4 g{self.group_size}"

    @property
    def codes_readable(self) -> bool:
        """Whether the 4-bit codes can be read back (kept plainly, or a checked packed layout)."""
        return self.codes is not None or self._readable

    def _codes(self, ids: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        if self.codes is not None:
            c = self.codes[ids]
            return torch.stack([c & 0x0F, c >> 4], dim=-1).view(*ids.shape, k)
        if self._readable:
            flat = ids.reshape(-1)
            rows = _cpu_int4_unpack_rows(self.packed, n, k, flat, self._block)
            return rows.view(*ids.shape, k)
        raise RuntimeError("Int4Weight: the packed layout cannot be read back here")

    def to_codes(self) -> GroupCodes:
        """The codes, scales and zero points this was packed from (the constants as stored)."""
        sz = self.scale_zero.float().transpose(0, 1)  # [N, K/g, 2]
        q = self._codes(torch.arange(self.shape[0], device=self.packed.device))
        return GroupCodes(q, sz[..., 0], sz[..., 1], self.group_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self._codes(ids)
        sz = self.scale_zero[:, ids]  # [K/g, *ids, 2]
        s = sz[..., 0].movedim(0, -1).repeat_interleave(self.group_size, dim=-1)
        z = sz[..., 1].movedim(0, -1).repeat_interleave(self.group_size, dim=-1)
        return ((q.to(self.dtype) - 8) * s + z).to(self.dtype)


def _inner_k_tiles(k: int) -> int:
    for t in (8, 4, 2):
        if k % (t * 16) == 0:
            return t
    raise ValueError(f"int4 on CUDA needs the input width to be a multiple of 32, got {k}")


class PlainWeight(PackedWeight):
    """A plain matrix (any float dtype) and ``F.linear``; in a state dict, the matrix."""

    kind = "plain"
    _constants = "w"

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__(tuple(w.shape))
        self.register_buffer("w", w.detach())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.w, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w)

    def dequantize(self) -> torch.Tensor:
        return self.w

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix.removesuffix(".")] = self.w


class Float32Weight(PlainWeight):
    """A float32 matrix on a CPU. One row (decode) is bound by memory: ``one_row`` takes
    :mod:`llmlib.kernels.matvec`'s kernel, where MKL streams one row slowly (CPUs not made by
    Intel). Several rows are bound by arithmetic: ``blocked`` keeps a second copy in oneDNN's
    blocked layout, faster there than MKL's generic code (at twice the memory). A compiled graph
    never reads that copy (:meth:`for_graph`): inductor takes the opaque tensor only as a frozen
    constant, and a graph given it as an input multiplied by garbage (the compiled engine's
    float32 bug on CPUs not made by Intel)."""

    def __init__(self, w: torch.Tensor, *, one_row: bool = False, blocked: bool = False) -> None:
        super().__init__(w)
        self.one_row = one_row
        # not a registered buffer: an opaque oneDNN tensor has no storage to save, copy or trace
        self.blocked = (
            torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
            if blocked
            else None
        )

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "float32" + (" + oneDNN copy" if self.blocked is not None else "")

    @property
    def nbytes(self) -> int:
        n = self.w.numel() * 4
        return n + (n if self.blocked is not None else 0)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.one_row and x.numel() == x.shape[-1]:
                y = torch.ops.llmlib_matvec.matvec(x, self.w).view(*x.shape[:-1], self.shape[0])
                return y if bias is None else y + bias
            if self.blocked is not None and x.numel() > x.shape[-1]:
                return torch.ops.mkldnn._linear_pointwise(x, self.blocked, bias, "none", [], "")
        return F.linear(x, self.w, bias)

    def for_graph(self) -> PackedWeight:
        """The same matrix without the blocked copy (the one-row kernel stays: an operator)."""
        return self if self.blocked is None else Float32Weight(self.w, one_row=self.one_row)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        w = self.w
        owns = w.is_contiguous() and w.untyped_storage().nbytes() == w.numel() * 4
        destination[prefix.removesuffix(".")] = w if owns else w.contiguous().clone()


class RowTiles(PackedWeight):
    """Any weight, multiplied ``tile`` rows at a time, the last tile padded with zero rows. BLAS
    and oneDNN pick their kernel, and with it each dot product's order of summation, from the
    shapes, the row count included, so a token's result depends on how many tokens share its
    step; with the row count fixed it cannot (:func:`llmlib.kernels.prepare.row_tiled`).
    ``tails``: smaller row counts the last tile may be padded to, so a step of a few tokens pays
    for a few rows; only counts computed exactly as a whole tile (:meth:`alike`)."""

    kind = "row tiles"

    def __init__(
        self, inner: torch.Tensor | PackedWeight, tile: int, tails: tuple[int, ...] = ()
    ) -> None:
        if not isinstance(tile, int) or tile <= 0:
            raise ValueError(f"RowTiles: tile must be a positive integer, got {tile!r}")
        if not all(0 < t < tile for t in tails):
            raise ValueError(f"RowTiles: tails {tails} must be between 0 and the tile ({tile})")
        super().__init__(tuple(inner.shape))
        self.tile = tile
        self.sizes = (*sorted(set(tails)), tile)  # what the last tile may be padded to
        if isinstance(inner, PackedWeight):
            self.inner = inner
        else:
            self.register_buffer("dense", inner.detach())
            self.inner = None

    @property
    def dtype(self) -> torch.dtype:
        return self.dense.dtype if self.inner is None else self.inner.dtype

    @property
    def device(self) -> torch.device:
        return self.dense.device if self.inner is None else self.inner.device

    @property
    def label(self) -> str:
        return (
            f"{self.dense.dtype if self.inner is None else self.inner.label}, {self.tile}-row tiles"
        )

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.inner is None:
            return F.linear(x, self.dense, bias)
        return self.inner.linear(x, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        n, t = rows.shape[0], self.tile
        tail = n % t and next(s for s in self.sizes if s >= n % t)  # 0: whole tiles
        padded = rows.new_zeros(n - n % t + tail, k)
        padded[:n] = rows
        out = torch.cat([self._product(padded[i : i + t], bias) for i in range(0, len(padded), t)])
        return out[:n].view(*lead, out.shape[-1])

    def alike(self, rows: int = 0) -> bool:
        """Whether one input row copied into every row of a tile gives the same bits in each; with
        ``rows``, a product of that many rows too (MKL takes some small products otherwise)."""
        x = torch.randn(1, self.shape[1], generator=torch.Generator().manual_seed(0))
        x = x.to(self.device, self.dtype)
        y = self._product(x.expand(self.tile, -1).contiguous(), None)
        if rows:
            y = torch.cat([y[:1], self._product(x.expand(rows, -1).contiguous(), None)])
        return bool((y == y[:1]).all())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.dense) if self.inner is None else self.inner.rows(ids)

    def dequantize(self) -> torch.Tensor:
        return self.dense if self.inner is None else self.inner.dequantize()


def pack_reference(codes: Codes, dtype: torch.dtype, device: torch.device | str) -> PackedWeight:
    """Codes in PyTorch's weight-only layout for ``device``; a ValueError names what cannot run."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight-only int8/int4 kernels exist for cpu and cuda, not {device}")
    if isinstance(codes, ChannelCodes):
        return Int8Weight(codes, dtype, device)
    if codes.bits != 4:
        raise ValueError(f"PyTorch has no kernel for {codes.bits}-bit codes in groups")
    return Int4Weight(codes, dtype, device)
