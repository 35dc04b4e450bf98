"""Dequantization of GGUF tensors: llama.cpp's block formats turned back into float32.

A GGUF file stores each weight matrix row by row, and a quantized row is cut into *blocks* of 32
numbers. Each block keeps one or two float16 constants (a scale ``d``, sometimes a minimum ``m``)
and then 32 small integers; the real value is recovered as ``d * q`` or ``d * q + m``. Storing
4-bit integers plus one float16 per 32 weights is why a Q4 file is about 4.5 bits per weight
instead of 16. The formats here are the ones small Llama GGUFs use:

=======  ==========  ===========  =============================================
type     block size  block bytes  layout and formula
=======  ==========  ===========  =============================================
F32      1           4            plain little-endian float32
F16      1           2            IEEE half precision
BF16     1           2            the top 16 bits of a float32
Q8_0     32          34           ``d:f16, q:int8[32]``;      ``x = d * q``
Q4_0     32          18           ``d:f16, q:uint4[32]``;     ``x = d * (q - 8)``
Q4_1     32          20           ``d:f16, m:f16, q:uint4[32]``; ``x = d * q + m``
=======  ==========  ===========  =============================================

In the 4-bit formats byte ``j`` of the 16 packed bytes holds element ``j`` in its low nibble and
element ``j + 16`` in its high nibble (not ``2j`` and ``2j + 1``): llama.cpp packs the two halves
of a block side by side so that its SIMD kernels can unpack 16 values with one mask and one shift.

Everything is vectorised over all the blocks of a tensor at once with numpy; the tests check every
format against the reference implementation in ``gguf.quants`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF tensor type lays out its numbers: ``block_size`` values in ``block_bytes`` bytes."""

    name: str
    type_id: int  # the ggml_type number written in the GGUF tensor header
    block_size: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


# ggml_type ids, from ggml.h (they are part of the file format and never change).
FORMATS: dict[int, BlockFormat] = {
    f.type_id: f
    for f in (
        BlockFormat("F32", 0, 1, 4),
        BlockFormat("F16", 1, 1, 2),
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("BF16", 30, 1, 2),
    )
}


def block_format(type_id: int, tensor_name: str = "tensor") -> BlockFormat:
    """The :class:`BlockFormat` of a ggml type id, or a ValueError that names the tensor."""
    fmt = FORMATS.get(int(type_id))
    if fmt is None:
        supported = ", ".join(f"{f.name} ({f.type_id})" for f in FORMATS.values())
        raise ValueError(
            f"{tensor_name}: unsupported GGUF quantization type {_type_name(type_id)} (id {int(type_id)}); "
            f"llmlib reads {supported}"
        )
    return fmt


def _type_name(type_id: int) -> str:
    try:  # a friendly name for the error message when the gguf package knows the id
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(type_id)).name
    except Exception:
        return "<unknown>"


def _f16(raw: np.ndarray) -> np.ndarray:
    """Reinterpret a [..., 2] uint8 array as float16 scalars and widen to float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n_blocks, 16] packed bytes -> [n_blocks, 32] values 0..15: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])  # [n, 1]
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)  # [n, 32]
    return q * d


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    q = _unpack_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)  # centre 0..15 on zero
    return d * q.astype(np.float32)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _unpack_nibbles(blocks[:, 4:]).astype(np.float32)
    return d * q + m


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is a float32 with the low 16 mantissa bits dropped: shift them back in as zeros.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


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
    raw = (
        np.frombuffer(data, dtype=np.uint8)
        if isinstance(data, (bytes, bytearray, memoryview))
        else data
    )
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
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
    else:
        blocks = raw.reshape(-1, fmt.block_bytes)
        decode = {"Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1}[fmt.name]
        out = decode(blocks)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(shape))
