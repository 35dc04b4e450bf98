"""The cost model against the source article's Llama-3-70B figures and against hand counts."""

from __future__ import annotations

import json

import pytest

from llmlib.analysis.costs import (
    GPUS,
    bytes_per_param,
    costs,
    expected_experts_read,
    flops_per_token,
    kv_bytes_per_token,
    param_counts,
    prefill_flops,
    weight_bytes,
)
from llmlib.cli.costs import main
from llmlib.config import ModelConfig, get_config


def close(actual: float, expected: float, rel: float = 0.02) -> bool:
    return abs(actual - expected) <= rel * abs(expected)


@pytest.fixture(scope="module")
def l70() -> dict:
    return costs("llama-3-70b", "h100-sxm", prompt_tokens=7, output_tokens=184).as_dict()


# --- the article's figures, within 2% ---------------------------------------------------------


def test_llama70b_weights(l70: dict) -> None:
    assert close(l70["weight_bytes"], 140e9)
    assert close(l70["bytes_per_layer"], 1.712e9)
    assert close(l70["embedding_bytes"], 2.1e9)
    assert close(l70["lm_head_bytes"], 2.1e9)
    assert close(l70["params_total"], 70.6e9)


def test_llama70b_kv_cache(l70: dict) -> None:
    assert l70["kv_bytes_per_token"] == 327_680  # exact: 2 x 80 x 8 x 128 x 2
    assert close(8000 * l70["kv_bytes_per_token"], 2.6e9)
    assert close(l70["final_kv_bytes"], 63e6)
    assert close(l70["prompt_kv_bytes"], 2.3e6)


def test_llama70b_ffn_share(l70: dict) -> None:
    assert close(l70["ffn_param_share"], 0.82)
    assert 0.82 <= l70["ffn_param_share"] < 0.83


def test_llama70b_decode_floor() -> None:
    assert close(costs("llama-3-70b", "h100-sxm").decode_ms_per_token, 41.0)
    assert close(costs("llama-3-70b", "h200").decode_ms_per_token, 29.0)
    # batch-1 decode is memory-bound: about one FLOP per byte at bf16, far below every ridge
    c = costs("llama-3-70b", "h100-sxm")
    assert 0.9 < c.decode_intensity < 1.1
    assert all(c.decode_intensity < g.ridge for g in GPUS.values())


def test_llama70b_request(l70: dict) -> None:
    assert close(l70["total_weight_traffic_bytes"], 25.2e12)
    assert close(l70["decode_total_s"], 7.7)
    assert close(l70["prefill_ms"], 40.0, rel=0.05)  # "roughly 40 ms"
    assert l70["prefill_bound"] == "memory"
    assert close(l70["gpu_ridge"], 295, rel=0.01)


def test_long_prompt_prefill_is_compute_bound() -> None:
    c = costs("llama-3-70b", "h100-sxm", prompt_tokens=2000, output_tokens=1)
    assert c.prefill_bound == "compute"
    assert c.prefill_intensity > GPUS["h100-sxm"].ridge


# --- hand counts on a small shape -----------------------------------------------------------

TINY = ModelConfig(
    name="tiny", vocab_size=100, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=16
)


def test_param_counts_tiny_by_hand() -> None:
    p = param_counts(TINY)
    # head_dim 2: q 8x8, k and v 4x8, o 8x8
    assert (p.attn_q, p.attn_k, p.attn_v, p.attn_o) == (64, 32, 32, 64)
    assert (p.ffn_gate, p.ffn_up, p.ffn_down) == (128, 128, 128)
    assert p.per_layer == 64 + 32 + 32 + 64 + 3 * 128 + 2 * 8
    assert p.total == 100 * 8 * 2 + 8 + 2 * p.per_layer
    assert weight_bytes(TINY, "f32") == 4 * p.total
    assert kv_bytes_per_token(TINY, "f32") == 2 * 2 * 2 * 2 * 4
    # one token at context 3: 2 FLOPs per matmul weight (layers + LM head) + 4*H*hd*S per layer
    assert flops_per_token(TINY, 3) == 2 * (2 * (192 + 384) + 800) + 2 * 4 * 4 * 2 * 3
    # prefill of 3 tokens: contexts 1, 2, 3
    assert prefill_flops(TINY, 3) == 3 * 2 * (2 * (192 + 384) + 800) + 2 * 4 * 4 * 2 * 6


def test_tied_embeddings_add_no_params_but_are_read() -> None:
    tied = TINY.replace(tie_embeddings=True)
    assert param_counts(tied).total == param_counts(TINY).total - 800
    assert costs(tied, "h100-sxm").lm_head_bytes == costs(TINY, "h100-sxm").lm_head_bytes


def test_smollm2_param_count() -> None:
    # SmolLM2-135M: 134,515,008 parameters (tied embeddings)
    assert param_counts(get_config("smollm2-135m")).total == 134_515_008


def test_moe_counts() -> None:
    cfg = get_config("mixtral-8x7b")
    p = param_counts(cfg)
    assert close(p.total, 46.7e9, rel=0.005)
    assert p.router == 8 * 4096
    assert p.ffn_active_per_layer == 2 * 3 * 14336 * 4096 + 8 * 4096
    assert expected_experts_read(cfg, 1) == pytest.approx(2.0)
    assert 7.9 < expected_experts_read(cfg, 64) <= 8.0


def test_quantization_bytes() -> None:
    assert bytes_per_param("q8_0") == pytest.approx(34 / 32)
    assert bytes_per_param("q4_1") == pytest.approx(0.625)
    c16, c8, c4 = (costs("llama-3-70b", "h100-sxm", dtype=d) for d in ("bf16", "int8", "int4"))
    assert c8.decode_ms_per_token == pytest.approx(c16.decode_ms_per_token / 2, rel=0.01)
    assert c4.decode_ms_per_token == pytest.approx(c16.decode_ms_per_token / 4, rel=0.01)
    assert c8.kv_bytes_per_token == c16.kv_bytes_per_token  # weight-only quantization
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_param("int3")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="gpu"):
        costs("llama-3-70b", "tpu-v9")
    with pytest.raises(ValueError, match="prompt_tokens"):
        costs("llama-3-70b", "h100-sxm", prompt_tokens=0)
    with pytest.raises(KeyError):
        costs("gpt-5", "h100-sxm")


def test_every_gpu_names_its_source() -> None:
    for g in GPUS.values():
        assert "datasheet" in g.source or "whitepaper" in g.source
        assert g.bandwidth_tbs > 0 and g.bf16_tflops > 0


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--model",
                "llama-3-70b",
                "--gpu",
                "h100-sxm",
                "--prompt-tokens",
                "7",
                "--output-tokens",
                "184",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for key in (
        "params_total",
        "weight_bytes",
        "bytes_per_layer",
        "kv_bytes_per_token",
        "ffn_param_share",
        "decode_ms_per_token",
    ):
        assert key in d
    assert close(d["decode_ms_per_token"], 41.0)
    assert main(["--model", "smollm2-135m", "--gpu", "l4"]) == 0
    assert "decode floor" in capsys.readouterr().out
    assert main(["--model", "nope"]) == 2
