"""Memory capacity and communication under tensor parallelism, from the configs alone."""

from __future__ import annotations

import json

import pytest

from llmlib.analysis.capacity import (
    RUNTIME_RESERVE,
    allreduce_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    min_gpus,
    shard,
    weight_bytes_per_gpu,
)
from llmlib.analysis.costs import weight_bytes
from llmlib.analysis.gpus import GPUS
from llmlib.cli.costs import main
from llmlib.config import PRESETS, get_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_one_gpu_holds_the_whole_model(name: str) -> None:
    assert weight_bytes_per_gpu(name, 1, "bf16") == pytest.approx(weight_bytes(name, "bf16"))


def test_llama_3_70b_needs_two_80gb_gpus() -> None:
    """The article's model: 141 GB of bf16 weights do not fit one H100 (80 GB) or one H200
    (141 GB, and some of it is reserved); two H100s hold them."""
    assert not shard("llama-3-70b", "h100-sxm", 1).fits
    assert not shard("llama-3-70b", "h200", 1).fits
    assert shard("llama-3-70b", "h100-sxm", 2).fits
    assert min_gpus("llama-3-70b", "h100-sxm") == 2
    assert min_gpus("llama-3-70b", "h200") == 2


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_kv_limited_batch_at_8k_context(tp: int) -> None:
    """The largest batch of 8K-token sequences is what the memory left after the weights holds,
    worked out here by hand from the shapes (8 KV heads split over tp GPUs, bf16)."""
    cfg = get_config("llama-3-70b")
    mem = GPUS["h100-sxm"].memory_gb * 1e9
    per_gpu_weights = weight_bytes("llama-3-70b", "bf16") / tp  # norms replicated: a few MB
    kv_token = 2 * cfg.n_layers * (cfg.n_kv_heads // tp) * cfg.head_dim * 2
    by_hand = int((mem * (1 - RUNTIME_RESERVE) - per_gpu_weights) / kv_token) // 8192
    s = shard("llama-3-70b", "h100-sxm", tp, context=8192)
    assert s.kv_bytes_per_token_per_gpu == kv_token
    assert abs(s.max_batch_at_context - by_hand) <= 1
    assert s.max_batch_at_context == s.kv_tokens_capacity // 8192


def test_more_gpus_hold_more_sequences_and_read_less_each() -> None:
    runs = [shard("llama-3-70b", "h100-sxm", tp, context=8192) for tp in (2, 4, 8)]
    assert [r.max_batch_at_context for r in runs] == sorted(r.max_batch_at_context for r in runs)
    assert runs[0].max_batch_at_context < runs[-1].max_batch_at_context
    assert runs[0].weight_read_ms > runs[1].weight_read_ms > runs[2].weight_read_ms


def test_allreduce_bytes_and_when_communication_sets_the_floor() -> None:
    cfg = get_config("llama-3-70b")
    per_layer, total = allreduce_bytes_per_token(cfg, "bf16")
    assert per_layer == 2 * cfg.d_model * 2 and total == cfg.n_layers * per_layer
    small = shard("llama-3-70b", "h100-sxm", 8, batch=1, context=1)
    big = shard("llama-3-70b", "h100-sxm", 8, batch=1024, context=1)
    assert small.comm_share < 0.01 < big.comm_share  # the all-reduce grows with the batch
    # a PCIe card's link is ~14x slower than NVLink: the same split spends far more on it
    pcie = shard("llama-3-70b", "l4", 8, batch=1024, context=1)
    assert pcie.allreduce_ms > 10 * big.allreduce_ms


def test_splits_must_be_whole_heads() -> None:
    with pytest.raises(ValueError, match="9 query heads do not split over 2"):
        shard("smollm2-135m", "l4", 2)
    s = shard("smollm2-135m", "l4", 3)
    assert s.kv_bytes_per_token_per_gpu == kv_bytes_per_token_per_gpu("smollm2-135m", 1) / 3
    # more GPUs than KV heads: each GPU still holds one head (replicated)
    assert kv_bytes_per_token_per_gpu("llama-3-70b", 16) == kv_bytes_per_token_per_gpu(
        "llama-3-70b", 8
    )


def test_costs_command_with_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--model",
                "llama-3-70b",
                "--gpu",
                "h100-sxm",
                "--tp",
                "8",
                "--context",
                "8192",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for key in (
        "tp",
        "weight_bytes_per_gpu",
        "fits",
        "kv_tokens_capacity",
        "max_batch_at_context",
        "allreduce_bytes_per_token",
        "allreduce_bytes_per_token_per_layer",
        "decode_ms_per_step",
    ):
        assert key in d
    assert d["tp"] == 8 and d["fits"] is True
    assert main(["--model", "smollm2-135m", "--tp", "2"]) == 2


def test_the_split_step_roofline() -> None:
    """step_ms adds the compute ceiling: memory-bound at small batches, compute-bound at large
    ones, and always at least each of its terms; and the batch at which the all-reduces outgrow
    the weight read is where the two times cross."""
    from llmlib.analysis.capacity import comm_over_weights_batch

    small = shard("llama-3-70b", "h100-sxm", 8, batch=1, context=1000)
    big = shard("llama-3-70b", "h100-sxm", 8, batch=4096, context=0 + 1)
    assert small.bound == "memory" and big.bound == "compute"
    for s in (small, big):
        assert s.step_ms >= max(s.weight_read_ms + s.kv_read_ms, s.compute_ms)
        assert s.step_ms == pytest.approx(
            max(s.weight_read_ms + s.kv_read_ms, s.compute_ms) + s.allreduce_ms
        )
        assert s.tokens_per_s == pytest.approx(s.batch / s.step_ms * 1e3)
    b = comm_over_weights_batch("llama-3-70b", "h100-sxm", 8)
    below = shard("llama-3-70b", "h100-sxm", 8, batch=b - 1, context=1)
    at = shard("llama-3-70b", "h100-sxm", 8, batch=b, context=1)
    assert below.allreduce_ms <= below.weight_read_ms < at.allreduce_ms
    assert comm_over_weights_batch("llama-3-70b", "h100-sxm", 1) is None
    # a PCIe link is slower than NVLink: the all-reduces outgrow the weights far sooner
    assert comm_over_weights_batch("llama-3-70b", "l4", 8) < b
