"""Dequantization of GGUF tensors: llama.cpp's block formats turned back into float32.

A GGUF file stores each weight matrix row by row, and a quantized row is cut into *blocks*. Each
block keeps one or two float16 constants (a scale ``d``, sometimes a minimum ``m``) and then small
integers; the real value is recovered as ``d * q`` or ``d * q + m``. Storing 4-bit integers plus
one float16 per 32 weights is why a Q4 file is about 4.5 bits per weight instead of 16. The
*K-quants* (``Q2_K`` .. ``Q6_K``) take this one level further: a *super-block* of 256 weights is
cut into sub-blocks of 16 or 32, each with its own scale (and minimum) stored as a small integer
too, and one float16 ``d`` (and ``dmin``) per super-block turns those integers into floats. A
sub-block's scale is then ``d * s``, its minimum ``dmin * m``.

=======  =====  =====  ===========================================================================
type     block  bytes  layout; formula (``j``: the weight's sub-block)
=======  =====  =====  ===========================================================================
F32      1      4      plain little-endian float32
F16      1      2      IEEE half precision
BF16     1      2      the top 16 bits of a float32
Q8_0     32     34     ``d:f16, q:i8[32]``; ``x = d * q``
Q4_0     32     18     ``d:f16, q:u4[32]``; ``x = d * (q - 8)``
Q4_1     32     20     ``d:f16, m:f16, q:u4[32]``; ``x = d * q + m``
Q5_0     32     22     ``d:f16, h:u1[32], q:u4[32]``; ``x = d * (q + 16 h - 16)``
Q5_1     32     24     ``d:f16, m:f16, h:u1[32], q:u4[32]``; ``x = d * (q + 16 h) + m``
Q2_K     256    84     ``sm:u8[16], q:u2[256], d:f16, dmin:f16``, 16 sub-blocks of 16;
                       ``x = d * (sm[j] & 15) * q - dmin * (sm[j] >> 4)``
Q3_K     256    110    ``h:u1[256], q:u2[256], s:u6[16], d:f16``, 16 sub-blocks of 16;
                       ``x = d * (s[j] - 32) * (q + 4 h - 4)``
Q4_K     256    144    ``d:f16, dmin:f16, s:u6[8], m:u6[8], q:u4[256]``, 8 sub-blocks of 32;
                       ``x = d * s[j] * q - dmin * m[j]``
Q5_K     256    176    ``d:f16, dmin:f16, s:u6[8], m:u6[8], h:u1[256], q:u4[256]``, 8 of 32;
                       ``x = d * s[j] * (q + 16 h) - dmin * m[j]``
Q6_K     256    210    ``q:u4[256], h:u2[256], s:i8[16], d:f16``, 16 sub-blocks of 16;
                       ``x = d * s[j] * (q + 16 h - 32)``
=======  =====  =====  ===========================================================================

Where the bits sit. Every packed field is a sequence of *runs* of bytes: a run of ``r`` bytes holds
``8 r / b`` values of ``b`` bits, first bits ``0 .. b-1`` of each of its bytes (values ``0 .. r-1``),
then the next ``b`` bits of each (values ``r .. 2r-1``), and so on; :func:`_unpack` reads every
field that way, only ``r`` changes. In the 32-weight blocks the 4-bit ``q`` is one run of 16 bytes
(byte ``i`` holds weight ``i`` in its low nibble and weight ``i + 16`` in its high one, so that
SIMD code unpacks 16 values with one mask and one shift), and ``h`` one run of one byte, i.e.
weight ``i`` in bit ``i`` of a little-endian 32-bit word. In the K-quants the 4-bit ``q`` of Q4_K
and Q5_K come in runs of 32 bytes, Q6_K's in runs of 64; the 2-bit fields (``q`` of Q2_K and Q3_K,
``h`` of Q6_K) in runs of 32; the 1-bit ``h`` of Q3_K and Q5_K is a single run of 32 bytes (weight
``32 b + i`` in bit ``b`` of byte ``i``). The 6-bit constants are packed in 12 bytes ``B``: for
Q4_K and Q5_K, ``s[j] = B[j] & 63`` and ``m[j] = B[j+4] & 63`` for ``j < 4``, and for ``j >= 4``
their low four bits are the two nibbles of ``B[j+4]`` and their top two bits the top two bits of
``B[j-4]`` and ``B[j]``; for Q3_K, the low four bits of ``s`` are the nibbles of ``B[0:8]`` (a run
of 8) and the top two bits the 2-bit fields of ``B[8:12]`` (a run of 4).

Decoding first takes a block apart into :class:`Blocks`: integers ``q`` and, per group of
consecutive weights (the block, or the sub-block), one float32 ``scale`` and one ``shift``, so
that ``x = scale * q + shift``, with nothing multiplied out. That form is also what the
weight-only kernels want (:mod:`llmlib.checkpoints.repack` turns it into codes exactly). Every
step is vectorised over all the blocks of a tensor at once with numpy, and the tests check every
format against the reference implementation in ``gguf.quants`` bit for bit. Other GGUF types (the
codebook ``IQ*`` formats, ternary ``TQ*``, ``MXFP4``, ...) are refused with an error that names
the tensor and the type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF tensor type lays out its numbers: ``block_size`` values in ``block_bytes``
    bytes, with one scale per ``group`` consecutive values (0 for the float types)."""

    name: str
    type_id: int  # the ggml_type number written in the GGUF tensor header
    block_size: int
    block_bytes: int
    group: int = 0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


# ggml_type ids, from ggml.h (they are part of the file format and never change).
FORMATS: dict[int, BlockFormat] = {
    f.type_id: f
    for f in (
        BlockFormat("F32", 0, 1, 4),
        BlockFormat("F16", 1, 1, 2),
        BlockFormat("Q4_0", 2, 32, 18, 32),
        BlockFormat("Q4_1", 3, 32, 20, 32),
        BlockFormat("Q5_0", 6, 32, 22, 32),
        BlockFormat("Q5_1", 7, 32, 24, 32),
        BlockFormat("Q8_0", 8, 32, 34, 32),
        BlockFormat("Q2_K", 10, 256, 84, 16),
        BlockFormat("Q3_K", 11, 256, 110, 16),
        BlockFormat("Q4_K", 12, 256, 144, 32),
        BlockFormat("Q5_K", 13, 256, 176, 32),
        BlockFormat("Q6_K", 14, 256, 210, 16),
        BlockFormat("BF16", 30, 1, 2),
    )
}
FORMATS_BY_NAME: dict[str, BlockFormat] = {f.name: f for f in FORMATS.values()}


def block_format(type_id: int | str, tensor_name: str = "tensor") -> BlockFormat:
    """The :class:`BlockFormat` of a ggml type id (or name), or a ValueError naming the tensor."""
    fmt = FORMATS_BY_NAME.get(type_id) if isinstance(type_id, str) else FORMATS.get(int(type_id))
    if fmt is None:
        supported = ", ".join(f.name for f in FORMATS.values())
        name, number = _type_name(type_id)
        raise ValueError(
            f"{tensor_name}: GGUF type {name} (id {number}) cannot be read: llmlib decodes "
            f"{supported}; the codebook (IQ*), ternary (TQ*) and other formats are not implemented"
        )
    return fmt


def _type_name(type_id: int | str) -> tuple[str, object]:
    try:  # a friendly name (or id) for the error message when the gguf package knows the type
        from gguf import GGMLQuantizationType as T

        t = T[type_id] if isinstance(type_id, str) else T(int(type_id))
        return t.name, t.value
    except Exception:
        return (type_id, "?") if isinstance(type_id, str) else ("<unknown>", int(type_id))


# ---- taking blocks apart --------------------------------------------------------------------


@dataclass
class Blocks:
    """A block format's numbers taken apart, nothing multiplied out: integers ``q`` (int8,
    ``[n_blocks, block_size]``, from ``low`` up) and, per group of ``block_size / G`` consecutive
    values, float32 ``scale`` and ``shift`` (``[n_blocks, G]``; ``shift`` None where the format
    has none): ``x = scale * q + shift``.

    A k-quant's scales are products, ``scale = unit * steps``: the block's float16 ``d``
    (``unit``, float32 ``[n_blocks, 1]``) times a small integer per group (``steps``, int8). The
    takers keep both, so a kernel can store a byte per group instead of a float32. Its shifts
    are products too, ``shift = shift_unit * shift_steps`` (``-dmin`` times the 6-bit minimum,
    exact in float32), where the format has them (Q4_K, Q5_K, Q2_K)."""

    q: np.ndarray
    scale: np.ndarray
    shift: np.ndarray | None
    low: int  # the smallest value q can hold: -8 for Q4_0, 0 for Q4_1, -32 for Q6_K, ...
    unit: np.ndarray | None = None
    steps: np.ndarray | None = None
    shift_unit: np.ndarray | None = None
    shift_steps: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """float32 ``[n_blocks, block_size]``, in the reference's order of operations."""
        n, groups = self.scale.shape
        x = self.q.reshape(n, groups, -1) * self.scale[..., None]  # int8 * float32 -> float32
        if self.shift is not None:
            x += self.shift[..., None]
        return x.reshape(n, -1)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Reinterpret a [..., 2] uint8 array as float16 scalars and widen to float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _int8(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.int8)


_SHIFTS = {b: np.arange(0, 8, b, dtype=np.uint8)[:, None] for b in (1, 2, 4)}


def _unpack(raw: np.ndarray, bits: int, run: int) -> np.ndarray:
    """``[n, bytes]`` -> ``[n, bytes * 8 / bits]`` values of ``bits`` bits (uint8). Each run of
    ``run`` bytes holds bits ``0 .. bits-1`` of its bytes first, then the next ``bits``, ..."""
    n = raw.shape[0]
    runs = raw.reshape(n, -1, 1, run) >> _SHIFTS[bits]  # [n, runs, 8 / bits, run]
    return (runs & np.uint8((1 << bits) - 1)).reshape(n, -1)


def _signed(q: np.ndarray, offset: int) -> np.ndarray:
    """uint8 values 0 .. 255 - offset -> int8 ``q - offset``."""
    return q.view(np.int8) - np.int8(offset) if offset else q.view(np.int8)


def _q8_0(b: np.ndarray) -> Blocks:
    return Blocks(_int8(b[:, 2:]), _f16(b[:, :2]), None, -128)


def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(_signed(_unpack(b[:, 2:], 4, 16), 8), _f16(b[:, :2]), None, -8)


def _q4_1(b: np.ndarray) -> Blocks:
    return Blocks(_signed(_unpack(b[:, 4:], 4, 16), 0), _f16(b[:, :2]), _f16(b[:, 2:4]), 0)


def _q5(b: np.ndarray) -> np.ndarray:
    """The 5-bit values of a Q5_0/Q5_1 block whose last 20 bytes are ``h:u1[32], q:u4[32]``."""
    return _unpack(b[:, -16:], 4, 16) | _unpack(b[:, -20:-16], 1, 1) << np.uint8(4)


def _q5_0(b: np.ndarray) -> Blocks:
    return Blocks(_signed(_q5(b), 16), _f16(b[:, :2]), None, -16)


def _q5_1(b: np.ndarray) -> Blocks:
    return Blocks(_signed(_q5(b), 0), _f16(b[:, :2]), _f16(b[:, 2:4]), 0)


def _k_blocks(
    q: np.ndarray, low: int, b: np.ndarray, d: int, steps: np.ndarray, dmin=None, mins=None
) -> Blocks:
    """A k-quant's :class:`Blocks`: group scales ``d * steps`` and shifts ``-(dmin * mins)`` in
    float32, as llama.cpp forms them, from the float16 ``d`` and ``dmin`` at those byte offsets
    of each block (no shifts where ``dmin`` is None)."""
    unit, steps = _f16(b[:, d : d + 2]), steps.view(np.int8)  # every step is below 128
    if dmin is None:
        return Blocks(q, unit * steps.astype(np.float32), None, low, unit, steps)
    neg = -_f16(b[:, dmin : dmin + 2])
    shift = -(-neg * mins.astype(np.float32))  # llama.cpp's -(dmin * m), the same bits
    return Blocks(
        q, unit * steps.astype(np.float32), shift, low, unit, steps, neg, mins.view(np.int8)
    )


def _scale_min_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes at offset 4 -> the 6-bit scales and minimums of the 8 sub-blocks."""
    lo, mid, hi = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = np.concatenate([lo & 63, (hi & 15) | (lo >> 6) << 4], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | (mid >> 6) << 4], axis=1)
    return sc, mn


def _q2_k(b: np.ndarray) -> Blocks:
    sm = b[:, :16]
    return _k_blocks(_signed(_unpack(b[:, 16:80], 2, 32), 0), 0, b, 80, sm & 15, 82, sm >> 4)


def _q3_k(b: np.ndarray) -> Blocks:
    q = _unpack(b[:, 32:96], 2, 32) | _unpack(b[:, :32], 1, 32) << np.uint8(2)
    s = _unpack(b[:, 96:104], 4, 8) | _unpack(b[:, 104:108], 2, 4) << np.uint8(4)
    return _k_blocks(_signed(q, 4), -4, b, 108, _signed(s, 32))


def _q4_k(b: np.ndarray) -> Blocks:
    sc, mn = _scale_min_k4(b)
    return _k_blocks(_signed(_unpack(b[:, 16:], 4, 32), 0), 0, b, 0, sc, 2, mn)


def _q5_k(b: np.ndarray) -> Blocks:
    sc, mn = _scale_min_k4(b)
    q = _unpack(b[:, 48:], 4, 32) | _unpack(b[:, 16:48], 1, 32) << np.uint8(4)
    return _k_blocks(_signed(q, 0), 0, b, 0, sc, 2, mn)


def _q6_k(b: np.ndarray) -> Blocks:
    q = _unpack(b[:, :128], 4, 64) | _unpack(b[:, 128:192], 2, 32) << np.uint8(4)
    return _k_blocks(_signed(q, 32), -32, b, 208, _int8(b[:, 192:208]))


_TAKE_APART = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def take_apart(blocks: np.ndarray, fmt: BlockFormat) -> Blocks:
    """The :class:`Blocks` of ``blocks [n_blocks, block_bytes]`` (uint8) of a block format."""
    return _TAKE_APART[fmt.name](blocks)


# ---- whole tensors --------------------------------------------------------------------------


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    # The simplest format spelled out (Going further 1 shows it); the others go through Blocks.
    d = _f16(blocks[:, :2])  # [n, 1]
    q = _int8(blocks[:, 2:]).astype(np.float32)  # [n, 32]
    return q * d


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is a float32 with the low 16 mantissa bits dropped: shift them back in as zeros.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_bytes(data: np.ndarray | bytes) -> np.ndarray:
    """Any array or buffer as a flat uint8 array (a view where it can be)."""
    raw = (
        np.frombuffer(data, dtype=np.uint8)
        if isinstance(data, (bytes, bytearray, memoryview))
        else data
    )
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def dequantize(
    data: np.ndarray | bytes, type_id: int, shape: tuple[int, ...], name: str = "tensor"
) -> torch.Tensor:
    """Decode the raw bytes of one GGUF tensor into a float32 torch tensor of ``shape``.

    ``shape`` is in numpy/torch order (the last dimension is the contiguous row), i.e. the reverse
    of the ``ne`` dimensions written in the GGUF header. ``data`` may be any array or buffer
    holding exactly the tensor's bytes (a memory-mapped slice from ``GGUFReader`` is fine: it is
    only read). Raises ValueError, naming ``name``, for an unsupported type or a wrong byte count.
    """
    fmt = block_format(type_id, name)
    raw = as_bytes(data)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if shape and shape[-1] % fmt.block_size:
        raise ValueError(
            f"{name}: row length {shape[-1]} is not a multiple of the {fmt.name} block size {fmt.block_size}"
        )
    expected = n // fmt.block_size * fmt.block_bytes
    if raw.size != expected:
        raise ValueError(
            f"{name}: {fmt.name} tensor of shape {tuple(shape)} needs {expected} bytes, found {raw.size} "
            "(truncated or corrupt file?)"
        )
    if fmt.name == "F32":
        out = raw.view(np.float32).copy()  # copy: never hand out a view into a read-only memory map
    elif fmt.name == "F16":
        out = raw.view(np.float16).astype(np.float32)
    elif fmt.name == "BF16":
        out = _dequant_bf16(raw)
    elif fmt.name == "Q8_0":
        out = _dequant_q8_0(raw.reshape(-1, fmt.block_bytes))
    else:
        out = take_apart(raw.reshape(-1, fmt.block_bytes), fmt).dequantize()
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(shape))
