"""A GGUF file's own blocks, repacked for the weight-only kernels without re-quantizing.

:mod:`llmlib.checkpoints.quant` takes every block format apart into integers ``q`` and, per group
of consecutive weights of a row, a float32 scale and shift: ``x = scale * q + shift``. That is
already what :class:`llmlib.quantize.GroupCodes` describes, ``w = (c - 2**(bits-1)) * s + z``;
only the codes move by a constant, and the zero point takes up what they moved:

======  =====  =====  ==========================================================================
type    bits   group  codes ``c``, scale ``s``, zero ``z``
======  =====  =====  ==========================================================================
Q4_0    4      32     ``c = q + 8`` (the stored nibble), ``s = d``, ``z = 0``
Q4_1    4      32     ``c = q``, ``s = d``, ``z = m + 8 d``
Q4_K    4      32     ``c = q``, ``s = d * s_j``, ``z = 8 s - dmin * m_j``
Q8_0    8      32     ``c = q + 128``, ``s = d``, ``z = 0``
Q5_0    6      32     ``c = q + 32`` (``q = q5 - 16``), ``s = d``, ``z = 0``
Q5_1    6      32     ``c = q + 32``, ``s = d``, ``z = m``
Q5_K    6      32     ``c = q + 32``, ``s = d * s_j``, ``z = -dmin * m_j``
Q6_K    6      16     ``c = q + 32`` (``q = q6 - 32``, so ``c`` is the stored q6), ``s = d * s_j``,
                      ``z = 0``
Q3_K    6      16     ``c = q + 32`` (``q = q3 - 4``), ``s = d * (s_j - 32)``, ``z = 0``
Q2_K    6      16     ``c = q + 32``, ``s = d * s_j``, ``z = -dmin * m_j``
======  =====  =====  ==========================================================================

The codes are the file's integers, exactly. Every type but Q8_0 has codes of at most six bits
(``q`` in -32..31), and keeps them in six: the kernels then read Q6_K in the file's own bytes
(:class:`llmlib.kernels.integer.VnniInt6Weight`). The 6- and 8-bit rows compute
``(c - 32) * s + z`` and ``(c - 128) * s + z``, which is ``q * s + z``, the reference's own
arithmetic: bit for bit the file's values. The 4-bit rows with
a minimum (Q4_1, Q4_K) compute ``(q - 8) * s + (8 s - m')`` where the file computes
``q * s - m'``. The products are exact (``s`` has at most 17 significant bits, ``q - 8`` four), so
the results agree bit for bit whenever the zero point ``8 s - m'`` is exact in float32, which it
is unless the exponents of ``8 s`` and ``m'`` lie far apart (about 13 binary places for Q4_1's
float16 constants, 7 for Q4_K's); otherwise they differ by the float32 rounding of ``z``, about
``2**-24 |z|`` (many units of the result's last place only where the result nearly cancels to
zero). Float types (F32, F16, BF16) have no codes: the loader keeps those matrices dense.

A fused projection (q/k/v, gate/up) is the row-wise concatenation of its parts, and a Q4_K_M file
mixes types inside one: ``attn_q``/``attn_k`` in Q4_K, ``attn_v`` in Q6_K. :func:`fuse` keeps
such parts apart, each multiplied in its own layout; where one matrix is needed they come to the
widest kind exactly (``CodeParts.fused``): a 4-bit code becomes a 6-bit one by adding 24 (``c - 8
= (c + 24) - 32``), and a group of 32 becomes two groups of 16 with the same scale and zero.

What can round is where a kernel keeps ``s`` and ``z``: in the activations' dtype. In float32
they are exact; in bfloat16 each keeps 8 of its significant bits. :func:`repack_error` measures
both effects on a real file.
"""

from __future__ import annotations

import numpy as np
import torch

from llmlib.checkpoints.quant import BlockFormat, as_bytes, block_format, take_apart
from llmlib.quantize import CodeParts, GroupCodes

#: the block types whose codes are 4 bits (the int4 kernels' layout), and 8 bits; every other
#: one's fit six
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
EIGHT_BIT = ("Q8_0",)


def code_format(kind: str, name: str = "tensor") -> BlockFormat:
    """The block format of ``kind``, or a ValueError naming the tensor where it has no codes."""
    fmt = block_format(kind, name)
    if fmt.block_size == 1:
        raise ValueError(
            f"{name}: {kind} is a float type, it has no integer codes (the loader keeps it dense)"
        )
    return fmt


def block_codes(kind: str, raw: torch.Tensor, name: str = "tensor") -> GroupCodes:
    """The codes of one block-quantized matrix ``raw [rows, bytes per row]`` (uint8) of type
    ``kind``, read from the bytes as they are (no float copy of the matrix is made)."""
    fmt = code_format(kind, name)
    rows, width = raw.shape
    if width % fmt.block_bytes:
        raise ValueError(
            f"{name}: a {kind} row of {width} bytes is not a whole number of "
            f"{fmt.block_bytes}-byte blocks"
        )
    parts_raw = as_bytes(raw.contiguous().numpy()).reshape(-1, fmt.block_bytes)
    parts = take_apart(parts_raw, fmt)
    shift = parts.shift if parts.shift is not None else np.zeros_like(parts.scale)
    if kind in FOUR_BIT:
        q = parts.q - np.int8(parts.low)  # 0..15: Q4_0's stored nibble, Q4_1's and Q4_K's q
        moved = 8 + parts.low  # what the kernel's "- 8" takes away that the file's q did not
        zero = shift + np.float32(moved) * parts.scale if moved else shift
        bits = 4
    elif kind in EIGHT_BIT:
        q = parts.q.view(np.uint8) ^ np.uint8(0x80)  # int8 q -> q + 128, in 0..255
        zero, bits = shift, 8
    else:
        q = (parts.q + np.int8(32)).view(np.uint8)  # q in -32..31 -> q + 32, in 0..63
        if q.size and q.max() > 63:
            raise ValueError(f"{name}: {kind} codes outside six bits (the reader is wrong)")
        zero, bits = shift, 6
    k = width // fmt.block_bytes * fmt.block_size
    unit = steps = shift_unit = shift_steps = None
    if parts.unit is not None:  # k-quants: each block's float16 d times an integer per group
        unit = torch.from_numpy(parts.unit.reshape(rows, -1))
        steps = torch.from_numpy(parts.steps.reshape(rows, -1))
    if parts.shift_unit is not None:  # and -dmin times an integer: the kernels' offsets
        shift_unit = torch.from_numpy(parts.shift_unit.reshape(rows, -1))
        shift_steps = torch.from_numpy(np.ascontiguousarray(parts.shift_steps).reshape(rows, -1))
    return GroupCodes(
        torch.from_numpy(q.view(np.uint8).reshape(rows, k)),
        torch.from_numpy(parts.scale.reshape(rows, -1)),
        torch.from_numpy(zero.reshape(rows, -1)),
        fmt.group,
        bits,
        unit,
        steps,
        shift_unit,
        shift_steps,
    )


def fuse(codes: list[GroupCodes]) -> GroupCodes | CodeParts:
    """The row-wise concatenation of the parts of a fused matrix: one matrix where the parts are
    codes of one kind, else the parts kept apart (:class:`~llmlib.quantize.CodeParts`, whose
    ``fused()`` is their widest common kind, exactly), so that each is read in its own bytes."""
    if len(codes) == 1:
        return codes[0]
    if len({(c.bits, c.group_size) for c in codes}) == 1:
        return GroupCodes.cat(codes)
    return CodeParts(tuple(codes))


#: fused module -> the checkpoint matrices it concatenates, in row order
FUSED = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"), "w_gate_up": ("w_gate", "w_up")}


def _parts(module: str) -> list[str]:
    for fused, parts in FUSED.items():
        if module.endswith(fused):
            base = module[: -len(fused)]
            return [f"{base}{p}.weight" for p in parts]
    return [f"{module}.weight"]


def model_codes(
    modules: list[str], blocks: dict[str, tuple[str, torch.Tensor]]
) -> dict[str, GroupCodes | CodeParts]:
    """``{module name: codes}`` for the modules whose every part the file stores in blocks.

    The parts of a fused projection that mix block types stay apart (:func:`fuse`: a Q4_K +
    Q6_K projection keeps 4-bit q/k and 6-bit v); one with a float part stays dense.
    """
    out: dict[str, GroupCodes | CodeParts] = {}
    for mod in modules:
        parts = _parts(mod)
        if not all(p in blocks for p in parts):
            continue
        out[mod] = fuse([block_codes(*blocks[p], name=p) for p in parts])
    return out


def repack_error(
    blocks: dict[str, tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
) -> dict[str, dict[str, float]]:
    """Per GGUF type: the largest difference between the repacked weights and the file's own
    values, relative to the largest weight of the matrix, ``codes`` (the codes and float32
    constants) and ``in_dtype`` (with the constants rounded to ``dtype`` as the kernel keeps them)."""
    from llmlib.checkpoints.quant import dequantize

    worst: dict[str, dict[str, float]] = {}
    for name, (kind, raw) in blocks.items():
        fmt = code_format(kind, name)
        shape = (raw.shape[0], raw.shape[1] // fmt.block_bytes * fmt.block_size)
        ref = dequantize(raw.contiguous().numpy(), fmt.type_id, shape, name)
        c = block_codes(kind, raw, name)
        top = ref.abs().max().clamp(min=1e-30)
        exact = (c.dequantize() - ref).abs().max() / top
        r = GroupCodes(
            c.q, c.scale.to(dtype).float(), c.zero.to(dtype).float(), c.group_size, c.bits
        )
        rounded = (r.dequantize() - ref).abs().max() / top
        w = worst.setdefault(kind, {"codes": 0.0, "in_dtype": 0.0, "tensors": 0})
        w["codes"] = max(w["codes"], float(exact))
        w["in_dtype"] = max(w["in_dtype"], float(rounded))
        w["tensors"] += 1
    return worst
