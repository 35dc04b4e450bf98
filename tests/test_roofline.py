"""The roofline model against hand counts on a tiny shape, and its verdict on both sides of the ridge."""

from __future__ import annotations

import pytest

from llmlib.analysis.costs import GPUS
from llmlib.analysis.roofline import (
    Roof,
    crossover_batch,
    decode,
    measure_machine,
    phase,
    predict,
    prefill,
)
from llmlib.config import ModelConfig, get_config

# vocab 100, d_model 8, 2 layers, 4 query heads and 2 KV heads of head_dim 2, FFN 16, untied
TINY = ModelConfig(
    name="tiny", vocab_size=100, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=16
)

# By hand, per layer: q 8x8=64, k 8x4=32, v 32, o 64 -> 192 attention; gate/up/down 3 x 16x8 = 384; norms 16.
# Matmul weights one token passes through: 2 x (192 + 384) + LM head 100x8 = 1952.
MATMUL = 2 * (192 + 384) + 800
LAYER_PARAMS = 192 + 384 + 16
KV_PER_TOKEN_F32 = 2 * 2 * 2 * 2 * 4  # K and V, 2 layers, 2 KV heads, head_dim 2, 4 bytes = 64
# activations per token per layer (values): norm out 8, qkv out 16, attn out written+read 16, W_O out 8,
# FFN in 8, gate+up out 32, down in 16, down out 8 = 112; 2 layers, float32; plus a float32 logits row of 100
ACT_PER_TOKEN_F32 = 2 * 112 * 4 + 100 * 4


def test_decode_counts_by_hand() -> None:
    ph = decode(TINY, batch=3, context=5, dtype="f32")
    # each of 3 rows: 2 FLOPs per matmul weight + attention 4 * layers * heads * head_dim * (5 + 1) positions
    assert ph.flops == 3 * (2 * MATMUL + 4 * 2 * 4 * 2 * 6)
    # weights once for the batch (layers, final norm, LM head) + one embedding row per row
    assert ph.weight_bytes == 4 * (2 * LAYER_PARAMS + 8 + 800) + 3 * 8 * 4
    # every row reads its 5 cached positions and writes 1
    assert ph.kv_bytes == 3 * 6 * KV_PER_TOKEN_F32
    assert ph.activation_bytes == 3 * ACT_PER_TOKEN_F32
    assert ph.bytes == ph.weight_bytes + ph.kv_bytes + ph.activation_bytes
    assert ph.intensity == pytest.approx(ph.flops / ph.bytes)


def test_prefill_counts_by_hand() -> None:
    ph = prefill(TINY, tokens=4, batch=2, dtype="f32")
    # causal: the 4 tokens see 1, 2, 3, 4 positions -> 10 query-key pairs per row
    assert ph.flops == 2 * (4 * 2 * MATMUL + 4 * 2 * 4 * 2 * 10)
    assert ph.weight_bytes == 4 * (2 * LAYER_PARAMS + 8 + 800) + 8 * 8 * 4
    assert ph.kv_bytes == 2 * 4 * KV_PER_TOKEN_F32
    assert ph.activation_bytes == 8 * ACT_PER_TOKEN_F32
    # a chunk after 3 cached tokens sees 4..7 positions: 22 pairs
    chunk = prefill(TINY, tokens=4, context=3, dtype="f32")
    assert chunk.flops == 4 * 2 * MATMUL + 4 * 2 * 4 * 2 * 22


def test_weight_only_quantization_shrinks_only_weight_bytes() -> None:
    full = decode(TINY, dtype="f32")
    q8 = decode(TINY, dtype="f32", weight_bits=8)
    q4 = decode(TINY, dtype="f32", weight_dtype="q4_1")
    assert q8.weight_dtype == "q8_0" and q4.weight_dtype == "q4_1"
    assert q8.flops == full.flops == q4.flops
    assert q8.kv_bytes == full.kv_bytes and q8.activation_bytes == full.activation_bytes
    # matrices shrink to 34/32 bytes (Q8_0) and 20/32 bytes (Q4_1) per weight; norms stay float32
    matrices = 2 * (192 + 384) + 800 + 8  # + one embedding row
    norms = 2 * 16 + 8
    assert q8.weight_bytes == pytest.approx(matrices * 34 / 32 + norms * 4)
    assert q4.weight_bytes == pytest.approx(matrices * 20 / 32 + norms * 4)
    # the Llama-3-70B decode floor on an H100: halved by 8-bit, about a third by 4-bit
    h100 = Roof.from_gpu("h100-sxm")
    t16, t8, t4 = (
        predict(decode("llama-3-70b", context=7, weight_bits=b), h100).time for b in (None, 8, 4)
    )
    assert t8 / t16 == pytest.approx(34 / 64, rel=0.02)
    assert t4 / t16 == pytest.approx(20 / 64, rel=0.02)


def test_classification_on_both_sides_of_the_ridge() -> None:
    roof = Roof("toy", peak_flops=1e12, bandwidth=1e11)  # ridge: 10 FLOPs per byte
    assert roof.ridge == 10
    low = decode(TINY, dtype="f32")
    assert low.intensity < roof.ridge
    p = predict(low, roof)
    assert p.bound == "memory" and p.time == p.t_memory == pytest.approx(low.bytes / 1e11)
    assert roof.attainable(low.intensity) == pytest.approx(low.intensity * 1e11)
    high = prefill(TINY, tokens=4096, dtype="f32")
    assert high.intensity > roof.ridge
    p = predict(high, roof)
    assert p.bound == "compute" and p.time == p.t_compute == pytest.approx(high.flops / 1e12)
    assert roof.attainable(high.intensity) == 1e12


def test_crossover_batch_flips_the_bound() -> None:
    for g in GPUS:
        roof = Roof.from_gpu(g)
        b = crossover_batch("llama-3.1-8b", roof, context=0)
        assert b is not None
        assert predict(decode("llama-3.1-8b", batch=b), roof).bound == "compute"
        assert predict(decode("llama-3.1-8b", batch=b - 1), roof).bound == "memory"
        # bf16 weights: about one FLOP per byte per row, so the crossover sits near the ridge
        assert 0.8 * roof.ridge < b < 1.5 * roof.ridge
    # at long contexts each row's own KV cache dominates, and decode never becomes compute-bound
    assert crossover_batch("llama-3-70b", Roof.from_gpu("h100-sxm"), context=8000) is None


def test_llama70b_floor_matches_costs() -> None:
    from llmlib.analysis.costs import costs

    p = predict(decode("llama-3-70b", context=7), Roof.from_gpu("h100-sxm"))
    assert p.bound == "memory"
    assert p.time * 1e3 == pytest.approx(
        costs("llama-3-70b", "h100-sxm").decode_ms_per_token, rel=1e-3
    )


def test_mfu_mbu() -> None:
    roof = Roof("toy", peak_flops=1e12, bandwidth=1e11)
    ph = decode(TINY, dtype="f32")
    p = predict(ph, roof)
    assert p.mbu(p.t_memory) == pytest.approx(1.0)
    assert p.mbu(2 * p.t_memory) == pytest.approx(0.5)
    assert p.mfu(p.t_compute) == pytest.approx(1.0)


def test_moe_batches_touch_more_experts() -> None:
    cfg = get_config("mixtral-8x7b")
    one, many = decode(cfg, batch=1), decode(cfg, batch=256)
    assert many.weight_bytes > 3 * one.weight_bytes  # 2 of 8 experts vs nearly all 8


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="kind"):
        phase(TINY, "train")
    with pytest.raises(ValueError, match="batch"):
        decode(TINY, batch=0)
    with pytest.raises(ValueError, match="weight_bits"):
        decode(TINY, weight_bits=3)
    with pytest.raises(ValueError, match="one token"):
        phase(TINY, "decode", tokens=2)
    with pytest.raises(ValueError):
        Roof("bad", 0, 1)


def test_measure_machine_small() -> None:
    c = measure_machine("cpu", dtypes=("float32",), reps=2, matmul_n=256, bandwidth_bytes=16 << 20)
    assert c.matmul_flops["float32"] > 1e8
    assert c.bandwidth > 1e8
    r = c.roof("f32")
    assert r.ridge == pytest.approx(c.matmul_flops["float32"] / c.bandwidth)
    with pytest.raises(ValueError, match="no matmul"):
        c.roof("bfloat16")


def test_last_only_prefill_skips_the_lm_head_rows() -> None:
    full = prefill(TINY, tokens=4, dtype="f32")
    last = prefill(TINY, tokens=4, dtype="f32", last_only=True)
    assert full.flops - last.flops == 3 * 2 * 800  # 3 rows x the LM head's 100x8 weights
    assert full.activation_bytes - last.activation_bytes == 3 * 100 * 4
    assert full.weight_bytes == last.weight_bytes  # the LM head is still read once


# --- the benchmark's pieces, on a tiny random model (fast; no model file) --------------------


def test_bench_pieces_on_a_tiny_model() -> None:
    import torch

    from llmlib.analysis.costs import param_counts, pass_weight_bytes
    from llmlib.bench import roofline as bench
    from llmlib.model import random_model

    cfg = TINY.replace(max_seq_len=64)
    model = random_model(cfg, device="cpu", dtype=torch.float32)
    # the matrices a decode step multiplies by: exactly the cost model's pass bytes minus the norms
    sec, nbytes = bench.time_weight_stream(model, reps=3)
    assert sec > 0
    p = param_counts(cfg)
    assert nbytes == pass_weight_bytes(cfg, "f32") - 4 * (
        cfg.n_layers * p.norms_per_layer + p.final_norm
    )
    assert sum(t.numel() for t in model.parameters()) == p.total
    roof = Roof("toy", 1e10, 1e9)
    pts = bench.measure_points(
        model, roof, prefill_lengths=(4,), decode_batches=(1, 3), context=5, reps=3
    )
    assert [(q.kind, q.batch, q.tokens) for q in pts] == [
        ("prefill", 1, 4),
        ("decode", 1, 1),
        ("decode", 3, 1),
    ]
    for q in pts:
        assert q.measured_s > 0 and q.predicted_s > 0
        assert q.mfu == pytest.approx(q.flops / q.measured_s / 1e10)
        assert q.mbu == pytest.approx(q.bytes / q.measured_s / 1e9)
    assert pts[2].flops == decode(cfg, batch=3, context=5, dtype="f32").flops
    assert pts[0].flops == prefill(cfg, tokens=4, dtype="f32", last_only=True).flops
    bd = bench.decode_breakdown(model, model, context=5, reps=2)
    assert bd["stream_bytes"] == nbytes
    assert all(bd[k] > 0 for k in ("step_s", "stream_s", "overhead_s"))


@pytest.mark.model
def test_bench_roofline_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    from llmlib.bench import roofline as bench

    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--json", "--threads", "1", "--large-layers", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads(capsys.readouterr().out)
    assert r["ceilings"]["bandwidth"] > 0 and r["ceilings"]["matmul_flops"]["float32"] > 0
    kinds = {(p["model"], p["kind"]) for p in r["points"]}
    assert ("smollm2-135m", "decode") in kinds and ("smollm2-135m", "prefill") in kinds
    assert r["smollm2_params"] == 134_515_008
    d1 = next(
        p
        for p in r["points"]
        if p["model"] == "smollm2-135m" and p["kind"] == "decode" and p["batch"] == 1
    )
    assert d1["bound"] == "memory"
    # a floor is a floor: the step cannot run much faster than bytes / measured bandwidth
    assert d1["measured_s"] > 0.5 * d1["predicted_s"]
