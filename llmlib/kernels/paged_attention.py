"""Decode attention read straight out of a KV cache where it lies: the CPU kernel.

Two caches hold a decoding query's keys in ways PyTorch's fused attention serves badly on a CPU:

* the batching engine's paged pool (:mod:`llmlib.engine.paged_cache`): ``index_select`` first
  copies every sequence's blocks into one padded tensor, a large share of a memory-bound step;
* a fixed-shape step (:class:`llmlib.engine.fixed_step.FixedStep`): every row attends over its
  table's width under a mask, and PyTorch's CPU kernel for one bfloat16 query costs several
  times its float32 one.

The kernel (``llmlib/kernels/csrc/paged_attention.cpp``, op ``llmlib_paged::decode_attention``)
walks a block table instead, reads each key and value once where it lies, stops at the
sequence's length and keeps the softmax running (flash attention's online form), so no sequence
pays for another's padding or for unused slots.

It serves on a CPU with AVX-512 or AVX2 and FMA, a compiler, float32, bfloat16 or int8 caches
(int8: codes and a scale per row, :func:`llmlib.engine.paged_cache.quantize_rows`), heads
a multiple of 16, a layer asking for the fused function (:func:`serves_spec`) and
``LLMLIB_PAGED_KERNEL`` not ``0`` (:attr:`llmlib.kernels.flags.Flags.paged_kernel`); elsewhere
PyTorch's operators, the tests' reference. On CUDA the same entry points go to the Triton
kernels of :mod:`llmlib.kernels.paged_triton`, under the same flag.
"""

from __future__ import annotations

import functools
import math

import torch

from llmlib.kernels import native
from llmlib.kernels.flags import flags
from llmlib.model.attention import AttentionSpec

_NAME = "llmlib_paged"


@functools.cache
def _load() -> bool:
    # built for AVX-512 or AVX2, named apart: a shared cache never hands one the other's
    isa = native.isa()
    cflags = native.flags_for(isa)
    if not native.build(f"{_NAME}_{isa}", "paged_attention.cpp", cflags, "paged attention kernel"):
        return False

    @torch.library.register_fake("llmlib_paged::decode_attention")
    def _(q, k, v, table, lens, scale, window, softcap):
        return q.new_empty(q.shape, dtype=torch.float32)

    return True


def available() -> bool:
    """Whether the kernel can run on this machine (builds it on the first call that needs it)."""
    return flags().paged_kernel and native.has_avx2() and _load()


def serves_pool(k_pool: torch.Tensor) -> bool:
    """Whether a pool ``[blocks, block_size, kv_heads, head_dim]`` has the kernel's layout here."""
    if k_pool.device.type != "cpu":  # CUDA, or the meta device tracing its step
        from llmlib.kernels import paged_triton

        return flags().paged_kernel and paged_triton.serves(k_pool)
    return (
        k_pool.device.type == "cpu"
        and k_pool.dtype in (torch.float32, torch.bfloat16, torch.int8)
        and (k_pool.shape[-1] - (4 if k_pool.dtype == torch.int8 else 0)) % 16 == 0
        and available()
    )


def serves_spec(spec: AttentionSpec) -> bool:
    """Whether the kernel computes what ``spec`` asks: the fused function, whatever its scale,
    soft cap or window (the book's naive and tiled attention keep their own arithmetic)."""
    return spec.backend == "sdpa"


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence and head ``q [n, H, hd]`` over each sequence's first ``lens[i]``
    keys (in the blocks ``table[i]`` names) -> ``[n, H, hd]`` in ``q``'s dtype; head ``h`` reads
    KV head ``h // (H / Hkv)``. CUDA and meta tensors go to :mod:`llmlib.kernels.paged_triton`."""
    if q.device.type != "cpu":
        from llmlib.kernels import paged_triton

        return paged_triton.decode_attention(
            q, k_pool, v_pool, table, lens, scale=scale, softcap=softcap, window=window
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.ops.llmlib_paged.decode_attention(
        q.contiguous(), k_pool, v_pool, table, lens, scale, window or 0, softcap or 0.0
    )
    return out.to(q.dtype)
