"""Device choice, timing and CUDA-graph decoding.

The tests without a mark run everywhere and exercise the CPU path (the same code, graphs off).
The ones marked ``gpu`` need CUDA and are skipped without it; ``benchmarks/gpu_check.py`` runs them
with ``pytest -m gpu`` on the GPU machine before its benchmarks.
"""

from __future__ import annotations

import pytest
import torch

from llmlib.analysis.roofline import measure_bandwidth
from llmlib.config import ModelConfig
from llmlib.device import Placement, Timer, choose, machine_info, pick_device, pick_dtype, time_fn
from llmlib.runtime.static import GraphedDecoder, StaticKVCache, compile_step, greedy_decode

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

CFG = ModelConfig(
    name="tiny",
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=128,
)


def _model(device="cpu", dtype=torch.float32, cfg=CFG, std=0.3):
    from llmlib.model import random_model

    return random_model(cfg, device=device, dtype=dtype, seed=0, std=std)


def _greedy_recompute(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The naive reference: rerun the whole sequence for every new token, no cache at all."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq[:, prompt.shape[1] :]


# ---- device choice ------------------------------------------------------------------------------


def test_defaults_follow_the_hardware():
    p = choose()
    assert p.device.type == ("cuda" if CUDA else "cpu")
    assert p.dtype == (torch.bfloat16 if CUDA else torch.float32)
    assert isinstance(p, Placement) and str(p)


def test_overrides_and_names():
    assert choose("cpu", "bf16") == Placement(torch.device("cpu"), torch.bfloat16)
    assert pick_dtype("cpu", "float16") == torch.float16
    assert pick_dtype("cuda", None) == torch.bfloat16  # the rule, even where no GPU is present
    assert pick_dtype("cpu", torch.float64) == torch.float64
    with pytest.raises(ValueError, match="dtype"):
        pick_dtype("cpu", "float8-ish")
    with pytest.raises(ValueError, match="floating"):
        pick_dtype("cpu", torch.int32)
    with pytest.raises(ValueError, match="device"):
        pick_device("not-a-device")


@pytest.mark.skipif(CUDA, reason="only meaningful without a GPU")
def test_asking_for_cuda_without_one_is_an_error():
    with pytest.raises(ValueError, match="no CUDA"):
        pick_device("cuda")


def test_timing_helpers():
    x = torch.randn(256, 256)
    with Timer("cpu") as t:
        x @ x
    assert t.seconds > 0
    assert time_fn(lambda: x @ x, "cpu", warmup=1, reps=3) > 0
    # any machine reads and copies > 100 MB/s
    assert min(measure_bandwidth("cpu", nbytes=8 << 20, reps=2, kind="copy")) > 1e8
    assert min(measure_bandwidth("cpu", nbytes=8 << 20, reps=2, kind="read")) > 1e8
    info = machine_info("cpu")
    assert (
        info["date"]
        and info["device_name"]
        and info["platform"]
        and info["torch"] == torch.__version__
    )


# ---- the graph-safe static cache and the decoder, on the CPU path ------------------------------------


def test_static_cache_follows_the_cache_contract():
    cache = StaticKVCache(CFG, max_batch=3, max_len=10)
    k = torch.randn(2, CFG.n_kv_heads, 4, CFG.head_dim)
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    k_all, v_all, mask = cache.update(0, k, k.clone(), pos)
    assert k_all.shape == (2, CFG.n_kv_heads, 10, CFG.head_dim)
    assert mask.shape == (2, 1, 4, 10) and mask.dtype == torch.bool
    assert torch.equal(k_all[:, :, :4], k)
    # causal, nothing unwritten
    assert torch.equal(mask[0, 0], torch.arange(10)[None] <= torch.arange(4)[:, None])
    assert cache.nbytes == 2 * CFG.n_layers * 3 * CFG.n_kv_heads * 10 * CFG.head_dim * 4


def test_cached_decode_equals_recompute():
    torch.manual_seed(0)
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (3, 7))
    out = greedy_decode(model, prompt, 12, use_graphs=False)
    assert torch.equal(out, _greedy_recompute(model, prompt, 12))


def test_decoder_logits_match_full_forward():
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    full = model(ids)
    cache = StaticKVCache(CFG, 2, 16)
    dec = GraphedDecoder(model, cache, (1, 2)).capture()
    assert not dec.enabled and not dec.graphs  # CPU: a passthrough
    with torch.no_grad():
        model(ids[:, :8], torch.arange(8).expand(2, 8), cache)
        step = dec(ids[:, 8:9], torch.full((2, 1), 8))
    torch.testing.assert_close(step[:, 0], full[:, 8], atol=1e-5, rtol=1e-5)


def test_decoder_rejects_bad_shapes_and_sizes():
    model = _model()
    cache = StaticKVCache(CFG, 2, 16)
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphedDecoder(model, cache, (1, 4))  # 4 > the cache's rows
    dec = GraphedDecoder(model, cache, (1, 2))
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        dec(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    assert dec._size_for(1) == 1 and dec._size_for(2) == 2
    with pytest.raises(ValueError, match="larger"):
        dec._size_for(3)
    with pytest.raises(ValueError):
        greedy_decode(model, torch.zeros(3, dtype=torch.long), 4)


def test_compile_step_is_identity_off_cuda():
    def f(x):
        return x + 1

    assert compile_step(f, enabled=False) is f
    if not CUDA:
        assert compile_step(f) is f


# ---- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_gpu_defaults_and_timer():
    assert choose() == Placement(torch.device("cuda"), torch.bfloat16)
    x = torch.randn(2048, 2048, device="cuda")
    with Timer("cuda") as t:
        for _ in range(10):
            x @ x
    assert t.seconds > 1e-5
    assert "cuda" in machine_info("cuda")["device"] and machine_info("cuda")["gpu_memory_bytes"] > 0


@pytest.mark.gpu
@gpu
def test_cuda_graphs_equal_eager_with_padding():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("cuda", torch.float32)
    cpu_model = _model("cpu")
    cpu_model.load_state_dict(model.state_dict())
    for b in (1, 3):  # 3 runs padded up to the captured size 4
        prompt = torch.randint(0, CFG.vocab_size, (b, 6), device="cuda")
        eager = greedy_decode(model, prompt, 20, use_graphs=False)
        graphed = greedy_decode(model, prompt, 20, use_graphs=True, batch_sizes=(1, 2, 4))
        assert torch.equal(eager, graphed)
        assert torch.equal(eager.cpu(), _greedy_recompute(cpu_model, prompt.cpu(), 20))


@pytest.mark.gpu
@gpu
def test_cuda_graph_replays_reuse_memory():
    model = _model("cuda", torch.bfloat16)
    cache = StaticKVCache(CFG, 4, 64, device="cuda", dtype=torch.bfloat16)
    dec = GraphedDecoder(model, cache, (1, 2, 4)).capture()
    assert dec.enabled and sorted(dec.graphs) == [1, 2, 4]
    ids = torch.randint(0, CFG.vocab_size, (2, 1), device="cuda")
    a = dec(ids, torch.zeros(2, 1, dtype=torch.long, device="cuda")).clone()
    b = dec(ids, torch.zeros(2, 1, dtype=torch.long, device="cuda"))
    assert torch.equal(a, b) and b.data_ptr() == dec.steps.entries[2][2].data_ptr()


@pytest.mark.gpu
@gpu
def test_model_on_gpu_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("cpu", torch.float32)
    on_gpu = _model("cuda", torch.float32)
    on_gpu.load_state_dict(model.state_dict())
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    ref = model(ids)
    got = on_gpu(ids.cuda()).cpu()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_engine_on_gpu_matches_single_requests():
    """The paged, batched engine on CUDA gives each prompt exactly its own greedy continuation."""
    from llmlib.engine import LLM
    from llmlib.sampling import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("cuda", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist()
        for n in (3, 9, 17, 30, 5, 41)
    ]
    llm = LLM(model, None, num_blocks=64, block_size=8, max_num_seqs=8)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        ref = greedy_decode(model, torch.tensor([p], device="cuda"), 16, use_graphs=False)[
            0
        ].tolist()
        assert o.token_ids == ref
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.gpu
@gpu
def test_bf16_graph_decode_of_a_real_shape():
    from llmlib.config import get_config

    cfg = get_config("smollm2-135m")
    model = _model("cuda", torch.bfloat16, cfg=cfg, std=0.02)
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    out = greedy_decode(model, prompt, 32, use_graphs=True)
    assert out.shape == (1, 32) and int(out.max()) < cfg.vocab_size
    assert torch.equal(out, greedy_decode(model, prompt, 32, use_graphs=False))
