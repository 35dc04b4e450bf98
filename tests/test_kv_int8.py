"""The int8 KV cache (``kv_cache_dtype="int8"``): rows rounded once when written, read by the
paged kernel as stored, and everywhere else widened back; the engine sized and run over it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_paged_kernel import TINY, _reference, needs_kernel

from llmlib.engine.kv_rows import (
    KV_CACHE_DTYPES,
    dequantize_rows,
    kv_bytes_per_value,
    quantize_rows,
)
from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.kernels import native
from llmlib.kernels import paged_attention as paged_kernel
from llmlib.model.attention import AttentionSpec


def test_rows_round_to_half_a_step_and_keep_their_scale() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[0, 0] = 0.0  # a row of zeros stays zeros (no division by its zero maximum)
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, atol=0, rtol=1e-6)
    codes = rows[..., :64].int()
    assert codes.abs().max() == 127 and codes.min() >= -127  # symmetric: -128 never used
    back = dequantize_rows(rows, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()  # within half a step
    assert dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_per_value_and_bad_names() -> None:
    assert kv_bytes_per_value("auto", torch.bfloat16, 64) == 2
    assert kv_bytes_per_value("int8", torch.bfloat16, 64) == 68 / 64  # llama.cpp q8_0's 34 / 32
    assert kv_bytes_per_value("int8", torch.float32, 128) == 132 / 128
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_bytes_per_value("fp4", torch.float32, 64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedKVCache(1, 4, 2, 16, 64, kv_cache_dtype="int4")
    cache = PagedKVCache(2, 4, 2, 16, 64, dtype=torch.bfloat16, kv_cache_dtype="int8")
    assert cache.k[0].dtype == torch.int8 and cache.k[0].shape == (4, 16, 2, 68)
    # the formula and the tensors agree on what a block takes
    held = sum(t[:1].numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert cache.bytes_per_block == held
    assert "int8" in KV_CACHE_DTYPES


@needs_kernel
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 16, 5), (12, 1, 32, 16)])
def test_kernel_reads_int8_rows_as_stored(qdtype, heads, hkv, d, bs) -> None:
    """The kernel over int8 rows equals attention over the same rows widened: the codes and
    scales are read where they lie, and nothing but the query's dtype rounds differently."""
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 15, 16, 17, 40, 100])
    nb = max(-(-int(x) // bs) for x in lens)
    blocks = len(lens) * nb + 3
    k = quantize_rows(torch.randn(blocks, bs, hkv, d, generator=g) * 2)
    v = quantize_rows(torch.randn(blocks, bs, hkv, d, generator=g))
    table = torch.randperm(blocks, generator=g)[: len(lens) * nb].view(len(lens), nb).contiguous()
    q = torch.randn(len(lens), heads, d, generator=g).to(qdtype)
    kd, vd = dequantize_rows(k, torch.float32), dequantize_rows(v, torch.float32)
    tol = 1e-5 if qdtype == torch.float32 else 2e-2  # bfloat16: the output's own rounding
    for opts in ({}, {"window": 20}, {"scale": 0.3}, {"softcap": 5.0, "scale": 0.5}):
        out = paged_kernel.decode_attention(q, k, v, table, lens, **opts)
        assert out.dtype == qdtype and out.shape == q.shape
        ref = _reference(q.float(), kd, vd, table, lens, **opts)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0, msg=f"{opts}")


@needs_kernel
@pytest.mark.parametrize("window", [None, 6])
def test_paged_step_same_with_and_without_kernel(window) -> None:
    """A packed step over an int8 pool (one prefill, four decodes): the kernel's rows equal the
    gather path's, which widens the blocks first; both wrote the same codes."""
    torch.manual_seed(0)
    H, HKV, D, BS = 6, 2, 16, 4
    seqs = [(9, 0), (13, 12), (7, 6), (30, 29), (5, 4)]
    pools = [PagedKVCache(1, 40, HKV, BS, D, kv_cache_dtype="int8") for _ in range(2)]
    perm = torch.randperm(40).tolist()
    tables, p = [], 0
    for n, _ in seqs:
        tables.append(perm[p : p + -(-n // BS)])
        p += -(-n // BS)
    for (n, done), t in zip(seqs, tables):
        if done:
            kv = torch.randn(1, HKV, done, D)
            for cache in pools:
                k_all, v_all, _ = cache.step([[SeqChunk(t, 0, done)]]).update(0, kv, kv.flip(-1))
                assert k_all.dtype == torch.float32  # widened back for the plain contract
    T = sum(n - done for n, done in seqs)
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, HKV, T, D), torch.randn(1, HKV, T, D)
    chunks = [[SeqChunk(t, done, n - done) for (n, done), t in zip(seqs, tables)]]
    assert pools[0].kernel
    pools[1].kernel = False
    fast, slow = (c.step(chunks).attend(0, q, k, v, AttentionSpec(window=window)) for c in pools)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    assert torch.equal(pools[0].k[0], pools[1].k[0]) and torch.equal(pools[0].v[0], pools[1].v[0])


@needs_kernel
@pytest.mark.parametrize("mode", [{}, {"cuda_graphs": True}])
def test_engine_over_an_int8_pool(mode, monkeypatch) -> None:
    """The engine sizes its pool by the int8 row's bytes; its tokens (eager, or every decode
    step a fixed-shape one) are those of the same pool read by the gather path; and scoring
    prompts in chunks of 16 (each chunk reading the earlier ones' rounded keys) moves each
    token's log-probability little from the float pool's."""
    from llmlib.engine import LLM, paged_cache
    from llmlib.model import random_model
    from llmlib.sampling import SamplingParams

    model = random_model(TINY, "cpu", torch.float32, seed=3, std=0.3)
    prompts = [[5 + (i * 7 + j) % 50 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)

    def engine(kv: str) -> LLM:
        return LLM(model, None, block_size=8, max_num_seqs=8, kv_cache_bytes=1 << 18,
                   max_num_batched_tokens=16, kv_cache_dtype=kv, **mode)  # fmt: skip

    def logprobs(llm: LLM) -> torch.Tensor:
        outs = llm.generate(prompts, score, use_tqdm=False)
        return torch.tensor([p.logprob for o in outs for p in o.prompt_logprobs[1:]])

    f32, int8 = engine("auto"), engine("int8")
    assert int8.runner.cache.k[0].dtype == torch.int8
    # the same bytes hold 4 * 16 / 20 as many tokens (head_dim 16: 16 codes and a scale)
    assert int8.engine_config.num_blocks == f32.engine_config.num_blocks * 64 // 20
    assert "in int8" in int8.engine_config.describe()
    got = logprobs(int8)
    assert (logprobs(f32) - got).abs().mean() < 0.05  # a small random model: sharp attention
    out = [o.token_ids for o in int8.generate(prompts, params, use_tqdm=False)]
    # exactly attention over rounded keys and values: a float pool fed them gives the same
    write = paged_cache.write_kv

    def rounded(cache, layout, layer, k, v):
        k, v = (dequantize_rows(quantize_rows(x.transpose(1, 2)), x.dtype) for x in (k, v))
        write(cache, layout, layer, k.transpose(1, 2), v.transpose(1, 2))

    with monkeypatch.context() as m:
        m.setattr(paged_cache, "write_kv", rounded)
        m.setattr(paged_cache, "serves_pool", lambda pool: False)
        if not mode:  # the eager step writes through paged_cache.write_kv
            torch.testing.assert_close(logprobs(engine("auto")), got, atol=1e-4, rtol=0)
    monkeypatch.setattr(paged_cache, "serves_pool", lambda pool: False)
    slow = engine("int8")
    assert not slow.runner.cache.kernel
    assert [o.token_ids for o in slow.generate(prompts, params, use_tqdm=False)] == out


def test_bad_kv_cache_dtype_names_the_field() -> None:
    from llmlib.engine import LLM
    from llmlib.model import random_model

    model = random_model(TINY, "cpu", torch.float32, seed=3)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model, None, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' with batch_invariant"):
        LLM(model, None, kv_cache_dtype="int8", batch_invariant=True)


def test_commands_take_kv_cache_dtype() -> None:
    import argparse

    from llmlib.cli.common import add_decode_args, engine_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    add_decode_args(ap, "compile")
    assert engine_config(ap.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_config(ap.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8"])


@pytest.mark.skipif(
    native.isa() != "avx512",
    reason="runs the AVX2 build where the AVX-512 one is the default (elsewhere the tests above do)",
)
def test_the_avx2_build_reads_int8_rows_too() -> None:
    # the paged kernel's other build (its own register budget), on int8 and float pools
    env = {**os.environ, "LLMLIB_NATIVE_ISA": "avx2"}
    float_tests = os.path.join(os.path.dirname(__file__), "test_paged_kernel.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, float_tests,
         "-k", "kernel_reads or same_with_and_without or gathered_keys or spans or its_batch"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("28 passed") and "skipped" not in last, run.stdout[-2000:]
