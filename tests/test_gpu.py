"""Device choice, timing and CUDA-graph decoding (the engine's fixed-shape steps, replayed).

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
from llmlib.sampling import SamplingParams

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


def _engine_greedy(model, prompts: list[list[int]], n: int, graphs: bool, **kw) -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens from the batching engine, its all-decode steps on fixed
    shapes (``graphs``: captured as CUDA graphs on a GPU, run as they are on a CPU) or eager."""
    from llmlib.engine import LLM

    kw = {"num_blocks": 64, "block_size": 8, "max_num_seqs": 8, **kw}
    llm = LLM(model, None, cuda_graphs=graphs, compile=False, **kw)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.block_manager.num_used_blocks == 0
    return outs


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


def test_a_gpu_before_sm_80_gets_float16_and_no_int4() -> None:
    """Colab's T4 (sm_75) and a V100 (sm_70) have no bfloat16 tensor cores: float16 there,
    and the int4 kernel refused with a sentence that names the GPU's generation."""
    from llmlib.device import cuda_half, int4_refused

    assert cuda_half((7, 5)) == cuda_half((7, 0)) == torch.float16
    assert cuda_half((8, 0)) == cuda_half((8, 9)) == cuda_half((9, 0)) == torch.bfloat16
    assert "sm_75" in int4_refused((7, 5)) and int4_refused((8, 0)) is None


FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "randn", "rand", "randint"}


def test_chapter_11_makes_no_tensor_off_the_models_device() -> None:
    """Every tensor chapter 11's cells make names its device (a CPU prompt handed to a model
    on the GPU fails there), and the device comes from llmlib.device's choice, never typed in."""
    import ast
    import json
    from pathlib import Path

    nb = json.loads(Path("chapters/11_the_full_generator.ipynb").read_text())
    calls, typed = [], []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        typed += [line for line in src.splitlines() if '"cuda' in line or "'cuda" in line]
        for node in ast.walk(ast.parse(src)):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute):
                if getattr(f.value, "id", None) == "torch" and f.attr in FACTORIES:
                    calls.append((ast.unparse(node), {k.arg for k in node.keywords}))
    assert calls, "the chapter makes a prompt tensor: the check must see it"
    assert all("device" in kws for _, kws in calls), [c for c, kws in calls if "device" not in kws]
    assert not typed, typed


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


# ---- the fixed-shape steps, on the CPU path ------------------------------------------------------


def test_fixed_shape_decode_equals_recompute():
    """The steps a GPU captures, run as they are on a CPU (several batch sizes, padded to the
    next bucket): the same tokens as rerunning the whole sequence for each new one."""
    model = _model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG.vocab_size, (7 + i,), generator=g).tolist() for i in range(3)]
    got = _engine_greedy(model, prompts, 12, graphs=True)
    for p, out in zip(prompts, got):
        assert out == _greedy_recompute(model, torch.tensor([p]), 12)[0].tolist()


def test_cuda_graphs_need_a_cuda_pool():
    from llmlib.engine.paged_cache import PagedKVCache
    from llmlib.engine.run_mode import pick_steps

    cache = PagedKVCache(CFG.n_layers, 9, CFG.n_kv_heads, 4, CFG.head_dim)
    with pytest.raises(ValueError, match="CUDA graphs need the KV pool on a CUDA device"):
        pick_steps("cuda-graphs", _model(), cache, scratch_block=8, max_rows=4, max_blocks=4)
    fixed = pick_steps("fixed", _model(), cache, scratch_block=8, max_rows=4, max_blocks=4)
    assert fixed.decode is not None and not fixed.decode.steps.enabled


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
    g = torch.Generator().manual_seed(0)
    for b in (1, 3):  # 3 runs padded up to the bucket of 4
        prompts = [torch.randint(0, CFG.vocab_size, (6,), generator=g).tolist() for _ in range(b)]
        eager = _engine_greedy(model, prompts, 20, graphs=False)
        graphed = _engine_greedy(model, prompts, 20, graphs=True)
        assert eager == graphed
        want = _greedy_recompute(cpu_model, torch.tensor(prompts), 20).tolist()
        assert eager == want


@pytest.mark.gpu
@gpu
def test_cuda_graph_replays_reuse_memory():
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
    from llmlib.engine.run_mode import pick_steps

    model = _model("cuda", torch.bfloat16)
    cache = PagedKVCache(
        CFG.n_layers, 17, CFG.n_kv_heads, 8, CFG.head_dim, device="cuda", dtype=torch.bfloat16
    )
    steps = pick_steps("cuda-graphs", model, cache, scratch_block=16, max_rows=4, max_blocks=4)
    assert steps.decode.capture() == 9  # 1, 2, 4 rows x 1, 2, 4 blocks
    chunks = [SeqChunk([0, 1], 9, 1), SeqChunk([2], 3, 1)]
    a = steps.decode.run(chunks, [5, 6]).clone()
    b = steps.decode.run(chunks, [5, 6])
    assert torch.equal(a, b) and steps.decode.replays == 2
    assert b.data_ptr() == steps.decode.steps.entries[(2, 2)][2].data_ptr()


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
        ref = _greedy_recompute(model, torch.tensor([p], device="cuda"), 16)[0].tolist()
        assert o.token_ids == ref
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.gpu
@gpu
def test_bf16_graph_decode_of_a_real_shape():
    from llmlib.config import get_config

    cfg = get_config("smollm2-135m")
    model = _model("cuda", torch.bfloat16, cfg=cfg, std=0.02)
    prompt = torch.randint(0, cfg.vocab_size, (32,)).tolist()
    kw = {"num_blocks": 32, "block_size": 16, "max_num_seqs": 1}
    out = _engine_greedy(model, [prompt], 32, graphs=True, **kw)[0]
    assert len(out) == 32 and max(out) < cfg.vocab_size
    assert out == _engine_greedy(model, [prompt], 32, graphs=False, **kw)[0]


def test_moe_steps_refuse_cuda_graphs_with_a_reason():
    """Mixture-of-experts routing learns its experts on the host, which a graph cannot replay:
    such a model's steps run on fixed shapes without capture, and the path says why."""
    from llmlib.engine.run_mode import capture_refused

    moe = CFG.replace(n_experts=4, n_experts_per_token=2)
    assert "mixture-of-experts" in capture_refused(_model(cfg=moe))
    assert capture_refused(_model()) is None
