"""The paged pool's two GPU kernels, written in Triton: decode attention read in place, and the
write of a step's new keys and values.

Without them, each decode step on a GPU copies its cache: every row's blocks are gathered with
``index_select`` into one tensor padded to the longest row (:mod:`llmlib.engine.paged_cache`)
before the fused attention reads it. At 256 rows of 128 blocks in an 8B model's shape that is
some 64 GiB a step, four times the 15 GiB of weights the step also reads.

**Decode attention** (:func:`decode_attention`): one program per (sequence, KV head), walking
the block table ``TILE`` keys at a time: key ``t`` sits in block ``table[t // block_size]`` at
slot ``t % block_size``, so a tile may span blocks of any size. Every query head sharing the KV
head scores the tile in one small matrix product, so each key and value is read once for all of
them. The softmax is online, as in flash attention: a running maximum ``m`` and sum ``l``,
rescaled by ``exp(m_old - m_new)``; nothing the size of the keys is written. A sliding window
starts the walk at its first key; a soft cap squashes scores to ``cap * tanh(score / cap)``
(Gemma 2). Tiles are counted from that first key whatever the block size, so a query's sums
depend on its own position alone (the batch-invariant mode relies on it).

**The KV write** (:func:`write_kv`): one program per new token copies its ``[Hkv, hd]`` keys
and values to pool slot ``slots[i]``; a negative slot (a padding row) writes nothing.

Both read every size from shapes and every index from device memory, so a CUDA graph captures
them; as ``torch.library.triton_op`` operators (``llmlib_triton::decode_attention``,
``::write_kv``) they are seen by ``torch.compile`` and ``torch.export``, and give shapes on the
meta device. They serve (:func:`serves`) contiguous CUDA pools of float32, bfloat16 or float16,
heads up to 256 (80 or 96 padded and masked); few long rows keep few programs busy (no split
over the keys).

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run on CPU tensors under
Triton's interpreter, so ``make test`` checks them without a GPU (``tests/test_paged_triton.py``).
The interpreter multiplies bfloat16 as integers and rounds to bfloat16 by truncating, so the
kernels multiply in float32 (TF32 on a GPU, exact for 16-bit inputs) and never round to 16 bits:
attention hands back float32, and new keys are converted by PyTorch before the write.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # no triton: serves() says no, and nothing below is defined
    triton = None

#: the pool dtypes the kernels serve
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
#: query heads per program (a GPU matrix product needs 16 rows: fewer are padded and masked)
HEADS = 16


def available() -> bool:
    """Whether triton can be imported here."""
    return triton is not None


def serves(k_pool: torch.Tensor) -> bool:
    """Whether the kernels serve a pool ``[num_blocks, block_size, kv_heads, head_dim]`` here:
    CUDA (or meta, tracing the CUDA step), triton, a served dtype and head size, contiguous."""
    return (
        k_pool.device.type in ("cuda", "meta")
        and available()
        and k_pool.dim() == 4
        and k_pool.dtype in DTYPES
        and k_pool.shape[-1] <= MAX_HEAD_DIM
        and k_pool.is_contiguous()
    )


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _tile(head_dim: int) -> int:
    """Keys per step of the walk: as many as fit in an H100's registers at 4 warps without
    spilling (``ptxas -v`` for sm_90a: 198 registers at 32 keys of 128 channels, 128 at 16 keys
    of 256; 64 keys of 128 spill)."""
    return 32 if head_dim <= 128 else 16


if triton is not None:

    @triton.jit
    def _decode_kernel(
        Q, K, V, Table, Lens, Out,
        scale, softcap, window,
        stride_qn, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_tn, stride_on, stride_oh,
        GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1) // tl.cdiv(GROUP, HEADS)
        first = (tl.program_id(1) % tl.cdiv(GROUP, HEADS)) * HEADS  # of the group, this program's
        g = first + tl.arange(0, HEADS)  # query heads within the group
        d = tl.arange(0, HEAD_DIM_P)  # channels, padded to a power of two
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        heads = kv_head * GROUP + g
        q_at = Q + row * stride_qn + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        length = tl.load(Lens + row).to(tl.int32)  # keys 0 .. length - 1; the query is the last
        start = 0
        if WINDOW:  # keys `window` or more behind the query are hidden
            start = tl.maximum(length - window, 0)
        m = tl.full([HEADS], float("-inf"), tl.float32)  # running maximum score, per head
        l = tl.zeros([HEADS], tl.float32)  # noqa: E741 - running sum of exp(score - m)
        acc = tl.zeros([HEADS, HEAD_DIM_P], tl.float32)  # running sum of weighted values
        for t0 in range(start, length, TILE):
            t = t0 + tl.arange(0, TILE)
            t_ok = t < length
            # the block table walk: the block of each key, then its row in that block
            block = tl.load(Table + row * stride_tn + t // BLOCK_SIZE, mask=t_ok, other=0)
            block = block.to(tl.int64)
            slot = t % BLOCK_SIZE
            kv_ok = t_ok[:, None] & d_ok[None, :]
            k_row = block * stride_kb + slot * stride_ks + kv_head * stride_kh
            k = tl.load(K + k_row[:, None] + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale  # [HEADS, TILE]
            if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
            s = tl.where(t_ok[None, :], s, float("-inf"))
            # every tile holds a visible key (t0 < length): m_new is finite
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)  # rescales what came before; 0 on the first tile
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)  # noqa: E741
            v_row = block * stride_vb + slot * stride_vs + kv_head * stride_vh
            v = tl.load(V + v_row[:, None] + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # no keys at all (length 0): zeros
        o_at = Out + row * stride_on + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_at, out, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _write_kernel(
        K, V, Slots, KN, VN,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_kn, stride_knh, stride_vn, stride_vnh,
        KV_HEADS: tl.constexpr, KV_HEADS_P: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        slot = tl.load(Slots + i).to(tl.int64)  # block * block_size + offset; < 0: padding
        h = tl.arange(0, KV_HEADS_P)
        d = tl.arange(0, HEAD_DIM_P)
        h_ok = (h < KV_HEADS) & (slot + 0 * h >= 0)  # (the slot's test broadcast over heads)
        ok = h_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(KN + i * stride_kn + h[:, None] * stride_knh + d[None, :], mask=ok)
        v = tl.load(VN + i * stride_vn + h[:, None] * stride_vnh + d[None, :], mask=ok)
        k_at = K + slot * stride_ks + h[:, None] * stride_kh + d[None, :]
        v_at = V + slot * stride_vs + h[:, None] * stride_vh + d[None, :]
        tl.store(k_at, k, mask=ok)
        tl.store(v_at, v, mask=ok)

    def _launcher(kernel, x: torch.Tensor):
        """How to run ``kernel`` on ``x``'s device: None on the meta device (a shape, no data);
        else the kernel, wrapped so that a trace records it (a CPU tensor: interpreted)."""
        from torch._subclasses.fake_tensor import is_fake

        if x.device.type == "meta" and not is_fake(x):
            return None
        if x.device.type == "cpu" and not _interpreted():
            raise RuntimeError(
                "CPU tensors run the Triton kernels under its interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported"
            )
        return wrap_triton(kernel)

    def _interpreted() -> bool:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(_decode_kernel, InterpretedFunction)

    @triton_op("llmlib_triton::decode_attention", mutates_args=())
    def _decode_op(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        softcap: float,
        window: int,
    ) -> torch.Tensor:
        n, H, D = q.shape
        _, bs, hkv, _ = k_pool.shape
        G = H // hkv
        out = torch.empty((n, H, D), dtype=torch.float32, device=q.device)
        launch = _launcher(_decode_kernel, q)
        if launch is None:
            return out
        grid = (n, hkv * triton.cdiv(G, HEADS))
        launch[grid](
            q, k_pool, v_pool, table, lens, out,
            scale, softcap, window,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), table.stride(0),
            out.stride(0), out.stride(1),
            GROUP=G, HEADS=HEADS, HEAD_DIM=D, HEAD_DIM_P=_pow2(D), BLOCK_SIZE=bs,
            TILE=_tile(D), SOFTCAP=softcap > 0, WINDOW=window > 0,
            DOT="ieee" if k_pool.dtype == torch.float32 else "tf32",
        )  # fmt: skip
        return out

    @triton_op("llmlib_triton::write_kv", mutates_args=("k_pool", "v_pool"))
    def _write_op(
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None:
        n, hkv, D = k_new.shape
        launch = _launcher(_write_kernel, k_pool)
        if launch is None:
            return
        launch[(n,)](
            k_pool, v_pool, slots, k_new, v_new,
            k_pool.stride(1), k_pool.stride(2), v_pool.stride(1), v_pool.stride(2),
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            KV_HEADS=hkv, KV_HEADS_P=_pow2(hkv, 1), HEAD_DIM=D, HEAD_DIM_P=_pow2(D),
        )  # fmt: skip


def _check(q_or_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("llmlib.kernels.paged_triton needs triton (pip install triton)")
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape or not k_pool.is_contiguous():
        raise ValueError(
            f"pools must be contiguous [blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if not v_pool.is_contiguous() or k_pool.dtype not in DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"pools must be contiguous and one of {DTYPES}")
    if q_or_new.dim() != 3 or q_or_new.shape[-1] != k_pool.shape[-1]:
        raise ValueError(f"expected [n, heads, {k_pool.shape[-1]}], got {tuple(q_or_new.shape)}")
    if k_pool.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head size {k_pool.shape[-1]} is over {MAX_HEAD_DIM}")


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
    """As :func:`llmlib.kernels.paged_attention.decode_attention`: ``q [n, H, hd]`` over each
    sequence's first ``lens[i]`` keys, in the blocks ``table[i]`` (int64 or int32) names."""
    _check(q, k_pool, v_pool)
    if q.shape[1] % k_pool.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k_pool.shape[2]}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    table, lens = table.contiguous(), lens.contiguous()  # (no copy where they already are)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = torch.ops.llmlib_triton.decode_attention(
        q, k_pool, v_pool, table, lens, scale, float(softcap or 0.0), int(window or 0)
    )
    return out.to(q.dtype)


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Store new keys and values ``[n, Hkv, hd]`` at pool slots ``slots[i]`` (negative: not
    written): ``pool.view(-1, Hkv, hd).index_copy_(0, slots, new)`` in one launch, padding rows
    left in (:func:`llmlib.engine.paged_cache.write_kv` hands it its step's ``write_slots``)."""
    _check(k_new, k_pool, v_pool)
    if v_new.shape != k_new.shape or k_new.shape[1] != k_pool.shape[2]:
        raise ValueError(f"new keys/values {tuple(k_new.shape)} do not fit {tuple(k_pool.shape)}")
    # converted by PyTorch: Triton's interpreter truncates to bfloat16 where a GPU rounds to
    # nearest (a no-op in the engine, whose new keys already have the pool's dtype)
    k_new, v_new = k_new.to(k_pool.dtype), v_new.to(v_pool.dtype)
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    torch.ops.llmlib_triton.write_kv(k_pool, v_pool, slots.contiguous(), k_new, v_new)
