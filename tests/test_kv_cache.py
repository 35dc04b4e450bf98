"""The static KV cache: its size is the formula, and decoding with it equals full recomputation."""

from __future__ import annotations

import pytest
import torch

from llmlib.config import ModelConfig
from llmlib.model import random_model
from llmlib.model.kv_cache import KVCache, kv_cache_bytes

CFG = ModelConfig(
    name="tiny",
    vocab_size=97,
    d_model=48,
    n_layers=3,
    n_heads=6,
    n_kv_heads=2,
    ffn_dim=96,
    max_seq_len=64,
    rope_theta=10_000.0,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(CFG, device="cpu", dtype=torch.float32, seed=0, std=0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_size_is_the_formula(dtype):
    cache = KVCache.from_config(CFG, batch=2, max_len=40, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes == kv_cache_bytes(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, 2 * 40, size)
    assert cache.nbytes == 2 * 3 * 2 * 8 * 80 * size
    assert cache.bytes_per_token == 2 * 3 * 2 * 8 * size
    assert tuple(cache.k.shape) == (3, 2, 2, 40, 8)


def test_size_matches_costs_module():
    costs = pytest.importorskip("llmlib.analysis.costs")
    cache = KVCache.from_config(CFG, max_len=10, dtype=torch.bfloat16)
    assert cache.bytes_per_token == costs.kv_bytes_per_token(CFG, "bf16")


def test_update_writes_and_returns_views():
    cache = KVCache(n_layers=2, batch=1, n_kv_heads=2, max_len=8, head_dim=4)
    k = torch.randn(1, 2, 3, 4)
    v = torch.randn(1, 2, 3, 4)
    for layer in range(2):
        k_all, v_all, mask = cache.update(layer, k, v, torch.arange(3)[None])
        assert mask is None  # prefill into an empty cache: plain causal
        assert torch.equal(k_all, k) and torch.equal(v_all, v)
        assert k_all.data_ptr() == cache.k[layer].data_ptr()  # a view, not a copy
    assert cache.length == 3  # advanced once the last layer wrote
    k1, v1 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    k_all, v_all, mask = cache.update(0, k1, v1, torch.tensor([[3]]))
    assert (
        k_all.shape == (1, 2, 4, 4)
        and torch.equal(k_all[:, :, 3:], k1)
        and torch.equal(k_all[:, :, :3], k)
    )
    assert mask.shape == (1, 1, 1, 4) and bool(mask.all())
    assert cache.length == 3  # layer 1 has not written yet
    cache.update(1, k1, v1, torch.tensor([[3]]))
    assert cache.length == 4
    cache.reset()
    assert cache.length == 0


def test_chunk_mask_is_causal_after_stored_tokens():
    cache = KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=8, head_dim=2)
    cache.update(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    _, _, mask = cache.update(0, torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


def test_errors():
    cache = KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=4, head_dim=2)
    with pytest.raises(ValueError, match="full"):
        cache.update(0, torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))
    with pytest.raises(ValueError, match="rows"):
        cache.update(0, torch.zeros(2, 1, 1, 2), torch.zeros(2, 1, 1, 2))
    with pytest.raises(ValueError, match="max_len"):
        KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=0, head_dim=2)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(3)


@torch.inference_mode()
def test_decode_with_cache_equals_full_recomputation(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=g)
    full = model(ids)  # [2, 20, V], no cache
    cache = KVCache.from_config(CFG, batch=2, max_len=32)
    pos = torch.arange(20).expand(2, 20)
    got = [model(ids[:, :8], pos[:, :8], cache)]  # prefill 8 tokens
    for t in range(8, 20):  # then one token at a time
        got.append(model(ids[:, t : t + 1], pos[:, t : t + 1], cache))
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=1e-4)
    assert cache.length == 20


@torch.inference_mode()
def test_chunked_prefill_equals_full(model):
    ids = torch.randint(0, CFG.vocab_size, (1, 15), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = KVCache.from_config(CFG, max_len=16)
    pos = torch.arange(15)[None]
    a = model(ids[:, :6], pos[:, :6], cache)
    b = model(ids[:, 6:], pos[:, 6:], cache)  # a chunk of 9 after 6 stored: needs the explicit mask
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-4, rtol=1e-4)
