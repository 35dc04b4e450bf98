"""The paged decode-attention kernel equals attention over the gathered keys (the two-pass path
it replaces), for every option a family sets, and the engine's tokens do not change with it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmlib.config import ModelConfig
from llmlib.engine import paged_cache
from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.kernels import paged_attention as paged_kernel
from llmlib.model.attention import AttentionSpec

needs_kernel = pytest.mark.skipif(
    not paged_kernel.available(),
    reason="no AVX-512 or AVX2, or no compiler: the kernel cannot run here",
)


def _pool_and_tables(n, lens, hkv, d, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-x // bs) for x in lens)
    blocks = n * nb + 3
    k = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g)
    table = perm[: n * nb].view(n, nb).contiguous()  # scattered, unsorted blocks
    return k, v, table


def _reference(q, k, v, table, lens, window=None, scale=None, softcap=None):
    """Gather each sequence's blocks, then attention in float64 under a mask."""
    n, H, D = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    nb = table.shape[1]
    kd = k[table.view(-1)].view(n, nb * bs, hkv, D).transpose(1, 2).double()
    vd = v[table.view(-1)].view(n, nb * bs, hkv, D).transpose(1, 2).double()
    pos = torch.arange(nb * bs)[None, :]
    mask = pos < lens[:, None]
    if window is not None:
        mask &= pos >= lens[:, None] - window
    kd, vd = kd.repeat_interleave(H // hkv, 1), vd.repeat_interleave(H // hkv, 1)
    s = (q.double()[:, :, None] @ kd.transpose(-1, -2)) * (scale or 1 / math.sqrt(D))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return (s.softmax(-1) @ vd)[:, :, 0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (4, 4, 16), (12, 1, 32), (16, 2, 128)])
def test_kernel_equals_attention_over_gathered_keys(dtype, heads, hkv, d) -> None:
    # 12 and 8 query heads per KV head: more than one pass over the keys (8 heads per pass)
    bs = 16
    lens = torch.tensor([1, 15, 16, 17, 40, 100])
    k, v, table = _pool_and_tables(len(lens), lens.tolist(), hkv, d, bs, dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for opts in ({}, {"window": 20}, {"scale": 0.3}, {"softcap": 5.0, "scale": 0.5}):
        out = paged_kernel.decode_attention(q, k, v, table, lens, **opts)
        assert out.dtype == dtype and out.shape == q.shape
        ref = _reference(q, k, v, table, lens, **opts)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0, msg=f"{opts}")


@needs_kernel
def test_block_size_not_a_multiple_of_the_chunk() -> None:
    # the kernel scores 16 keys at a time, never across a block's end
    lens = torch.tensor([5, 23, 37])
    k, v, table = _pool_and_tables(3, lens.tolist(), 2, 16, 6, torch.float32)
    q = torch.randn(3, 4, 16)
    out = paged_kernel.decode_attention(q, k, v, table, lens)
    torch.testing.assert_close(out.double(), _reference(q, k, v, table, lens), atol=1e-5, rtol=0)


def test_only_the_fused_function_is_replaced() -> None:
    assert paged_kernel.serves_spec(AttentionSpec())
    assert paged_kernel.serves_spec(AttentionSpec(scale=0.5, window=8, softcap=3.0))
    # the book's own arithmetic stays what it is
    assert not paged_kernel.serves_spec(AttentionSpec("naive"))
    assert not paged_kernel.serves_spec(AttentionSpec("tiled", scale=0.5))


@needs_kernel
@pytest.mark.parametrize("window", [None, 6])
def test_paged_step_same_with_and_without_kernel(window) -> None:
    """A packed step (prefills and decodes in one row): the kernel's decode rows equal the
    gather path's, prefill rows are untouched."""
    torch.manual_seed(0)
    H, HKV, D, BS = 6, 2, 16, 4
    seqs = [(9, 0), (13, 12), (7, 6), (30, 29), (5, 4)]  # one prefill, four decodes
    cache = PagedKVCache(1, 40, HKV, BS, D)
    perm = torch.randperm(40).tolist()
    tables, p = [], 0
    for n, _ in seqs:
        tables.append(perm[p : p + -(-n // BS)])
        p += -(-n // BS)
    for (n, done), t in zip(seqs, tables):
        if done:
            kv = torch.randn(1, HKV, done, D)
            cache.step([[SeqChunk(t, 0, done)]]).update(0, kv, kv.flip(-1))
    T = sum(n - done for n, done in seqs)
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, HKV, T, D), torch.randn(1, HKV, T, D)
    spec = AttentionSpec(window=window)
    chunks = [[SeqChunk(t, done, n - done) for (n, done), t in zip(seqs, tables)]]
    assert cache.kernel
    fast = cache.step(chunks).attend(0, q, k, v, spec)
    cache.kernel = False  # the gather path, as where the kernel cannot run
    slow = cache.step(chunks).attend(0, q, k, v, spec)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


#: a small model whose next tokens are peaked (random weights, std 0.3): greedy runs agree exactly
TINY = ModelConfig(
    name="tiny", vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
    max_seq_len=256, rope_theta=50_000.0, norm_eps=1e-6, tie_embeddings=False, bos_token_id=1,
    eos_token_ids=(2,),
)  # fmt: skip


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=needs_kernel),
        pytest.param(  # the Triton kernels (tests/test_paged_triton.py) on a GPU
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_engine_tokens_unchanged_by_the_kernel(device, monkeypatch) -> None:
    """The engine's greedy tokens with the paged kernel serving its pool equal the gather
    path's: the C++ kernel on a CPU, the Triton kernels on a GPU."""
    from llmlib.engine import LLM
    from llmlib.model import random_model
    from llmlib.sampling import SamplingParams

    model = random_model(TINY, device, torch.float32, seed=3, std=0.3)
    prompts = [[5 + (i * 7 + j) % 50 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(model, None, block_size=8, max_num_seqs=8)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fast = run()
    monkeypatch.setattr(paged_cache, "serves_pool", lambda pool: False)
    assert run() == fast


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_fixed_step_kernel_same_as_masked_attention(dtype, window) -> None:
    """The engine's fixed-shape step: its queries handed to the kernel as they lie equal the
    masked attention over the gathered blocks, for rows at different positions (prompt tokens
    of one sequence and decode rows of others, every token a row) and padding rows."""
    from llmlib.engine.fixed_step import FixedStep
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk

    torch.manual_seed(0)
    H, Hkv, D, bs = 6, 2, 16, 4
    pools = [PagedKVCache(1, 13, Hkv, bs, D, dtype=dtype) for _ in range(2)]
    pools[1].kernel = False  # the same pool read by the masked path
    for p in pools[1:]:
        p.k[0].copy_(pools[0].k[0].normal_())
        p.v[0].copy_(pools[0].v[0].normal_())
    tables = [[3, 7, 1, 0], [5, 2, 9, 4]]
    # a prompt chunk of sequence 0 (positions 6..9), two decode rows of sequence 1
    chunks = [SeqChunk(tables[0], 6, 4), SeqChunk(tables[1], 13, 1), SeqChunk(tables[1], 2, 1)]
    q = torch.randn(1, H, 8, D).to(dtype)
    k, v = (torch.randn(1, Hkv, 8, D).to(dtype) for _ in range(2))
    spec = AttentionSpec(window=window)
    out = []
    for pool in pools:
        step = FixedStep(pool, 8, 4, scratch_block=12, masked=not pool.kernel)
        step.fill(chunks, [0] * 6)  # 6 real rows, 2 padding
        out.append(step.attend(0, q, k, v, spec)[:, :, :6])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[0].float(), out[1].float(), atol=tol, rtol=0)
    assert torch.equal(pools[0].k[0], pools[1].k[0])  # the same slots written


def test_reference_is_plain_attention() -> None:
    # the test's own reference agrees with PyTorch's fused attention on one gathered sequence
    lens = torch.tensor([10])
    k, v, table = _pool_and_tables(1, [10], 2, 16, 4, torch.float32)
    q = torch.randn(1, 4, 16)
    kd = k[table.view(-1)].view(1, -1, 2, 16)[:, :10].transpose(1, 2)
    vd = v[table.view(-1)].view(1, -1, 2, 16)[:, :10].transpose(1, 2)
    sd = F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(_reference(q, k, v, table, lens).float(), sd, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("window", [None, 21])
def test_a_querys_sums_do_not_depend_on_the_block_size(window) -> None:
    """The same keys in pools of 4-, 16- and 7-key blocks give bitwise the same output: the
    kernel's chunks of keys follow the query's position, not the blocks (the batch-invariant
    mode runs the same request in pools of different block sizes)."""
    g = torch.Generator().manual_seed(3)
    n, H, hkv, D, L = 3, 6, 2, 32, 70
    keys = torch.randn(n, L, hkv, D, generator=g)
    vals = torch.randn(n, L, hkv, D, generator=g)
    q = torch.randn(n, H, D, generator=g)
    lens = torch.tensor([70, 33, 5])
    outs = []
    for bs in (4, 16, 7):
        nb = -(-L // bs)
        perm = torch.randperm(n * nb, generator=g)  # the blocks scattered over the pool
        table = perm.view(n, nb).contiguous()
        pad = torch.zeros(n, nb * bs - L, hkv, D)
        k = torch.empty(n * nb, bs, hkv, D)
        v = torch.empty(n * nb, bs, hkv, D)
        k[table.view(-1)] = torch.cat([keys, pad], 1).view(n * nb, bs, hkv, D)
        v[table.view(-1)] = torch.cat([vals, pad], 1).view(n * nb, bs, hkv, D)
        outs.append(paged_kernel.decode_attention(q, k, v, table, lens, window=window))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = _reference(q, k, v, table, lens, window=window)
    assert torch.allclose(outs[2].double(), ref, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (10, 2, 16), (12, 1, 32), (32, 8, 16)])
def test_long_sequences_shared_out_in_spans(dtype, heads, hkv, d) -> None:
    """Sequences longer than a span (256 keys) are cut into spans that threads share, then
    merged; KV heads go several to a pass where registers allow (3 and 2 here, 4 of 8), one
    KV head's 12 query heads in passes of 8. All of it equals attention over gathered keys."""
    bs = 16
    lens = torch.tensor([1000, 17, 700, 257, 256])
    k, v, table = _pool_and_tables(len(lens), lens.tolist(), hkv, d, bs, dtype, seed=5)
    q = torch.randn(len(lens), heads, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for opts in ({}, {"window": 300}, {"softcap": 5.0, "scale": 0.5}):
        out = paged_kernel.decode_attention(q, k, v, table, lens, **opts)
        ref = _reference(q, k, v, table, lens, **opts)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0, msg=f"{opts}")


@needs_kernel
@pytest.mark.parametrize("window", [None, 300])
def test_a_querys_output_does_not_depend_on_its_batch(window) -> None:
    """How the kernel cuts its work (spans, heads per item, threads) depends on the batch;
    a query's arithmetic must not: alone or beside longer sequences, the same bits."""
    lens = torch.tensor([600, 2000, 40, 1300])
    k, v, table = _pool_and_tables(len(lens), lens.tolist(), 2, 32, 16, torch.float32, seed=9)
    q = torch.randn(len(lens), 6, 32)
    batch = paged_kernel.decode_attention(q, k, v, table, lens, window=window)
    for i in range(len(lens)):
        alone = paged_kernel.decode_attention(
            q[i : i + 1], k, v, table[i : i + 1].contiguous(), lens[i : i + 1], window=window
        )
        assert torch.equal(alone[0], batch[i]), i
