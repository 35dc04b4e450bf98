"""A GGUF file's own blocks, repacked for the weight-only kernels without re-quantizing.

llama.cpp's 4-bit blocks already are what :class:`llmlib.quantize.GroupCodes` describes: 32
weights of a row, one code of 4 bits each, and per block a scale (and a minimum). Only the
constants move:

* Q4_1 stores ``x = d * q + m``, ``q`` in 0..15. The int4 kernels compute ``(q - 8) * s + z``,
  so ``s = d`` and ``z = m + 8 d``: the same codes, group size 32.
* Q4_0 stores ``x = d * (q - 8)``: ``s = d``, ``z = 0``.
* Q8_0 stores ``x = d * q`` with ``q`` in int8 and one ``d`` per 32 weights; the int8 kernel
  takes one scale per *row*, so these rows are re-quantized from the file's values
  (:func:`llmlib.quantize.quantize_int8`): the one step here that is not exact.

The codes and the arithmetic are exact; what can round is where the kernel keeps ``s`` and
``z``: in the activations' dtype. In float32 they are exact (``d`` and ``m`` are float16); in
bfloat16 each keeps 8 of float16's 11 significant bits. :func:`repack_error` measures both
effects on a real file.
"""

from __future__ import annotations

import torch

from llmlib.quantize import ChannelCodes, Codes, GroupCodes, quantize_int8

BLOCK = 32


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float32 values of the float16 they hold."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes -> [..., 32] codes: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def block_codes(kind: str, raw: torch.Tensor, name: str = "tensor") -> Codes:
    """The codes of one block-quantized matrix ``raw [rows, bytes per row]`` of type ``kind``."""
    n = raw.shape[0]
    if kind == "Q4_1":
        b = raw.view(n, -1, 20)
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:]).reshape(n, -1)
        return GroupCodes(q, d, m + 8 * d, BLOCK)
    if kind == "Q4_0":
        b = raw.view(n, -1, 18)
        d = _f16(b[..., 0:2])
        q = _nibbles(b[..., 2:]).reshape(n, -1)
        return GroupCodes(q, d, torch.zeros_like(d), BLOCK)
    if kind == "Q8_0":
        b = raw.view(n, -1, 34)
        d = _f16(b[..., 0:2])
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return quantize_int8((q * d[..., None]).reshape(n, -1))  # per-row scale: re-quantized
    raise ValueError(
        f"{name}: GGUF type {kind} has no repacking path for quantization='gguf' "
        "(Q4_0, Q4_1 and Q8_0 have one); load it with quantization='int8' or 'int4'"
    )


#: fused module -> the checkpoint matrices it concatenates, in row order
FUSED = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"), "w_gate_up": ("w_gate", "w_up")}


def _parts(module: str) -> list[str]:
    for fused, parts in FUSED.items():
        if module.endswith(fused):
            base = module[: -len(fused)]
            return [f"{base}{p}.weight" for p in parts]
    return [f"{module}.weight"]


def model_codes(modules: list[str], blocks: dict[str, tuple[str, torch.Tensor]]) -> dict:
    """``{module name: codes}`` for the modules whose every part the file stores in blocks.

    A fused projection whose parts mix 4-bit and 8-bit blocks becomes int8 throughout (its 4-bit
    parts re-quantized per row); one with a float part stays dense.
    """
    out: dict[str, Codes] = {}
    for mod in modules:
        parts = _parts(mod)
        if not all(p in blocks for p in parts):
            continue
        codes = [block_codes(*blocks[p], name=p) for p in parts]
        if all(isinstance(c, GroupCodes) for c in codes):
            out[mod] = GroupCodes.cat(codes) if len(codes) > 1 else codes[0]
        else:
            as8 = [
                c if isinstance(c, ChannelCodes) else quantize_int8(c.dequantize()) for c in codes
            ]
            out[mod] = ChannelCodes.cat(as8) if len(as8) > 1 else as8[0]
    return out


def repack_error(
    blocks: dict[str, tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
) -> dict[str, dict[str, float]]:
    """Per GGUF type: the largest difference between the repacked weights and the file's own
    values, relative to the largest weight of the matrix, ``codes`` (the codes and float32
    constants) and ``in_dtype`` (with the constants rounded to ``dtype`` as the kernel keeps them)."""
    from llmlib.checkpoints.quant import dequantize

    worst: dict[str, dict[str, float]] = {}
    ids = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
    for name, (kind, raw) in blocks.items():
        type_id, nbytes = ids[kind]
        shape = (raw.shape[0], raw.shape[1] // nbytes * BLOCK)
        ref = dequantize(raw.numpy().reshape(-1), type_id, shape, name)
        c = block_codes(kind, raw, name)
        top = ref.abs().max().clamp(min=1e-30)
        exact = (c.dequantize() - ref).abs().max() / top
        if isinstance(c, GroupCodes):
            r = GroupCodes(c.q, c.scale.to(dtype).float(), c.zero.to(dtype).float(), c.group_size)
        else:
            r = ChannelCodes(c.q, c.scale.to(dtype).float())
        rounded = (r.dequantize() - ref).abs().max() / top
        w = worst.setdefault(kind, {"codes": 0.0, "in_dtype": 0.0, "tensors": 0})
        w["codes"] = max(w["codes"], float(exact))
        w["in_dtype"] = max(w["in_dtype"], float(rounded))
        w["tensors"] += 1
    return worst
