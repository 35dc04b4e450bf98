"""The int8 KV cache's rows: ``kv_cache_dtype="int8"`` on :class:`llmlib.LLM`.

A key or value row of one token and one KV head (``head_dim`` numbers) is stored as ``head_dim``
int8 codes followed by its float32 scale, ``[..., head_dim + 4]`` int8: ``code = round(x / s)``
with ``s = max|x| / 127``, symmetric, as a key's sign carries meaning. A row is rounded once,
when written (:func:`quantize_rows`), and read in one place: by the paged kernel as it lies
(:mod:`llmlib.kernels.paged_attention`), elsewhere widened back (:func:`dequantize_rows`). The pool
stays one tensor per layer, so a compiled step takes it as it takes a float pool.

At ``head_dim`` 64 a value takes 68 / 64 = 1.06 bytes against bfloat16's 2: llama.cpp's ``q8_0``
cache (32 codes and a float16 scale) takes the same. The cache formula of chapter 1 holds with
that number for its bytes per element (:func:`kv_bytes_per_value`).
"""

from __future__ import annotations

import torch

#: how the pool holds keys and values: ``auto`` in the model's dtype, ``int8`` as codes with a
#: scale per row (the names vLLM's ``kv_cache_dtype`` and llama.cpp's cache types use)
KV_CACHE_DTYPES = ("auto", "int8")

#: bytes an int8 row carries beyond its codes: the float32 scale
SCALE_BYTES = 4


def kv_bytes_per_value(kv_cache_dtype: str, dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one key or value element takes in the pool (an int8 row's scale shared out)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "int8":
        return (head_dim + SCALE_BYTES) / head_dim
    return dtype.itemsize


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D]`` -> ``[..., D + 4]`` int8: ``round(x / s)`` with ``s = max|x| / 127``
    per row, then ``s``'s four bytes (symmetric: a key's sign carries meaning)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    codes = torch.round(x * (127.0 / amax.clamp_min(torch.finfo(torch.float32).tiny)))
    return torch.cat([codes.to(torch.int8), (amax / 127.0).view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 rows ``[..., D + 4]`` -> ``[..., D]`` in ``dtype``: each code times its row's scale."""
    D = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :D].float() * rows[..., D:].view(torch.float32)).to(dtype)


def read_blocks(pool: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``blocks`` of a pool, ``[n, block_size, Hkv, D]`` in ``dtype`` (int8: widened)."""
    rows = pool.index_select(0, blocks)
    return dequantize_rows(rows, dtype) if pool.dtype == torch.int8 else rows
