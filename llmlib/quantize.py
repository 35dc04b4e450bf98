"""Weight-only quantization: fewer bytes per weight, multiplied as stored.

Decoding one token reads every weight once (chapter 9), so the bytes per weight set the floor.
Weight-only quantization stores each matrix as small integers plus a few float constants and
leaves the activations in a float format; a kernel made for the layout reads the integers and
scales them on the fly, inside the product, so the float matrix never exists in memory.

Two layouts, each with its own PyTorch kernel:

* :class:`Int8Weight` — one int8 per weight and one scale per output channel (row):
  ``w[n, k] = scale[n] * q[n, k]``, ``q`` in -127..127 (symmetric: ``scale = max|w[n]| / 127``).
  Kernel: ``torch.ops.aten._weight_int8pack_mm`` (CPU and CUDA).
* :class:`Int4Weight` — one 4-bit code per weight, and a scale and a zero point per *group* of
  ``group_size`` consecutive weights of a row: ``w = (q - 8) * scale + zero``, ``q`` in 0..15.
  Asymmetric (min to max of the group), so a group whose weights are all positive wastes no
  codes. Kernels: ``_weight_int4pack_mm_for_cpu`` and, on CUDA, ``_weight_int4pack_mm``; each
  wants the codes re-ordered into its own packed layout (``_convert_weight_to_int4pack*``).

The codes before packing are :class:`ChannelCodes` and :class:`GroupCodes`, plain tensors row by
row: a fused matrix (q/k/v, gate/up) is the row-wise concatenation of its parts, and a GGUF
file's blocks become codes as stored (:mod:`llmlib.checkpoints.repack`; no kernel takes its 8-bit
group codes yet). :func:`quantize_model` swaps a loaded model's matrices for packed ones, whose
product and row lookup :func:`llmlib.kernels.linear.linear` and ``embedding_rows`` call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmlib.dtypes import QUANTIZATIONS

INT4_GROUP_SIZES = (32, 64, 128, 256)


# ---- codes: what a quantizer produces, row by row, before any kernel's layout -------------------


@dataclass
class ChannelCodes:
    """int8 codes ``q [N, K]`` and one float32 scale per row: ``w = scale[:, None] * q``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @staticmethod
    def cat(parts: list[ChannelCodes]) -> ChannelCodes:
        return ChannelCodes(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class GroupCodes:
    """Codes ``q [N, K]`` (uint8, ``0 .. 2**bits - 1``) and per-group float32 ``scale``/``zero``
    ``[N, K/g]``: ``w[n, k] = (q[n, k] - 2**(bits-1)) * scale[n, k // g] + zero[n, k // g]``.

    ``bits=4`` is the int4 layout (``q - 8``); ``bits=8`` holds 8-bit codes with a scale and an
    offset per group, which is what most of a GGUF file's block types are once their constants
    are multiplied out (:mod:`llmlib.checkpoints.repack`)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int = 4

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def offset(self) -> int:
        """What a code's value is measured from: 8 for 4-bit codes, 128 for 8-bit ones."""
        return 1 << (self.bits - 1)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        s = self.scale.repeat_interleave(g, dim=1)
        z = self.zero.repeat_interleave(g, dim=1)
        return (self.q.float() - self.offset) * s + z

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        kinds = {(p.group_size, p.bits) for p in parts}
        if len(kinds) != 1:
            raise ValueError(
                f"cannot fuse matrices with different (group size, bits) {sorted(kinds)}"
            )
        g, bits = kinds.pop()
        return GroupCodes(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            g,
            bits,
        )


Codes = ChannelCodes | GroupCodes


def quantize_int8(w: torch.Tensor) -> ChannelCodes:
    """Symmetric int8 per output channel: ``scale = max|w[n]| / 127``, ``q = round(w / scale)``."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ChannelCodes(q, scale)


def quantize_int4(w: torch.Tensor, group_size: int = 32, name: str = "weight") -> GroupCodes:
    """Asymmetric int4 in groups of ``group_size`` along each row: the group's minimum to its
    maximum in 15 steps. Returns codes in the kernels' convention ``(q - 8) * scale + zero``."""
    check_group_size(group_size, w.shape[1], name)
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return GroupCodes(q.view(n, k), scale, lo + 8 * scale, group_size)


def check_group_size(group_size: int, in_features: int, name: str) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{name}: int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
    if in_features % group_size:
        raise ValueError(
            f"{name}: int4 group size {group_size} does not divide its {in_features} input "
            f"columns; choose one of "
            f"{[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none (keep int8)'}"
        )


# ---- packed weights: the layouts the kernels read ------------------------------------------------


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
        """The activations' dtype: what goes into and comes out of the product (``.to(dtype)``
        moves the float constants, and with them this)."""
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

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={tuple(self.shape)}, dtype={self.dtype}"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# PyTorch's CPU int8 kernel, with bfloat16 activations, reads past the end of a row whose width is
# not a multiple of 16: wrong products, or a crash (found on the families' odd test widths; float32
# and float16 were fine). Such matrices get zero columns up to the next multiple whatever the
# dtype (a later ``.to(bfloat16)`` must not meet the bug), and each input as many zeros: the same
# products, exactly. Real models' widths are multiples already, so they pay nothing.
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


# PyTorch's CPU int4 layout packs output channels in blocks of B: 64 where ATen's kernel was
# built for AVX-512, 32 for AVX2. For each input column k a block holds B/2 bytes; channel n sits
# in lane (n % B) // 16, byte (lane % (B // 32)) * 16 + n % 16, in the low nibble for the first
# half of the lanes and the high one for the rest. Reading a row back (the embedding lookup of a
# tied table) needs this map; Int4Weight checks it against the codes at pack time and keeps the
# plain codes instead where the kernel packed differently (another CPU, another version).
_CPU_BLOCKS_N = (64, 32)


def _cpu_int4_unpack_rows(
    packed: torch.Tensor, n: int, k: int, ids: torch.Tensor, block: int = 64
) -> torch.Tensor:
    """Codes ``[len(ids), k]`` (0..15) of rows ``ids`` of a matrix packed for the CPU kernel in
    blocks of ``block`` channels."""
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


def pack(codes: Codes, dtype: torch.dtype, device: torch.device | str) -> PackedWeight:
    """Codes in the layout of the kernel for ``device``; a ValueError names what cannot run."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight-only int8/int4 kernels exist for cpu and cuda, not {device}")
    if isinstance(codes, ChannelCodes):
        return Int8Weight(codes, dtype, device)
    if codes.bits != 4:
        raise ValueError(f"no kernel multiplies {codes.bits}-bit group codes yet (only int4 ones)")
    return Int4Weight(codes, dtype, device)


# ---- a whole model -------------------------------------------------------------------------------


def weight_matrices(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of every product weight a model multiplies by (name without ``.weight``):
    the fused projections, the output projections, the LM head (the embedding table when tied)."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            out[name] = mod
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.tie_embeddings:
        out["embed"] = model.embed
    return out


def quantize_model(
    model: nn.Module,
    quantization: str,
    *,
    group_size: int = 32,
    codes: dict[str, Codes] | None = None,
    describe=str,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Replace every weight matrix of ``model`` by a packed one, in place; return ``model``.

    ``quantization`` is ``"int8"`` or ``"int4"`` (quantize the model's float weights; int4 keeps
    the LM head in int8), or ``"gguf"``: ``codes`` hands in, by module name, codes made from the
    file's own blocks; a matrix without codes (or with 8-bit ones, which no kernel takes yet)
    stays dense in the model's dtype. ``describe``: a module name -> what the checkpoint calls
    it, for errors. ``dtype``: the activations' (default: the model's); the caller casts the rest.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}"
        )
    dtype = dtype or model.dtype
    for name, mod in weight_matrices(model).items():
        w = mod.weight
        label = describe(f"{name}.weight")
        if quantization == "gguf":
            c = (codes or {}).get(name)
            if c is None or (isinstance(c, GroupCodes) and c.bits != 4):
                continue  # no codes, or 8-bit group codes no kernel takes yet: the file's values
        elif quantization == "int8" or name in ("embed", "lm_head"):
            # int4 keeps the LM head (the tied table too) in int8, as llama.cpp's 4-bit files
            # do: the one matrix every logit comes from is the one 4 bits hurt most
            c = quantize_int8(w)
        else:
            c = quantize_int4(w, group_size, label)
        try:
            packed = pack(c, dtype, w.device)
        except (RuntimeError, ValueError) as e:
            raise ValueError(
                f"{label}: {quantization} weights cannot be packed here: {e}"
            ) from None
        if isinstance(packed, Int4Weight) and name == "embed":
            packed.keep_codes_for_rows(c)
        del mod.weight  # the dense Parameter goes: the weights are held once
        mod.weight = packed
    return model
