"""The GPU check rehearsed on the CPU (``--dry-run``), so the script that a GPU machine runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = [
    "tests",
    "copy_bandwidth",
    "smollm2_batch1",
    "llama8b_batch1",
    "llama8b_formats",
    "engine_throughput",
    "paged_kernel",
    "serve_sweep",
    "tensor_parallel",
]


def test_gpu_check_dry_run(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "gpu_check.json").exists()  # a rehearsal never poses as a real result
    rep = json.loads((tmp_path / "gpu_check.dry_run.json").read_text())
    assert rep["schema"] == "llmlib.gpu_check/1" and rep["dry_run"] is True and rep["ok"] is True
    assert rep["date"] and rep["machine"]["device_name"] and rep["machine"]["platform"]
    assert list(rep["sections"]) == SECTIONS
    s = rep["sections"]
    assert all(sec["ok"] for sec in s.values()), {k: v.get("error") for k, v in s.items()}
    # the fields the chapter reads exist, with sane values
    assert s["copy_bandwidth"]["copy_bandwidth_GBps"] > 0
    sm = s["smollm2_batch1"]
    assert (
        sm["llmlib_graphs"]["tok_s"] > 0
        and sm["transformers"]["tok_s"] > 0
        and sm["graphs_match_eager"]
    )
    # same weights, fp32: the same greedy tokens
    assert sm["transformers_tokens_agree"] == sm["new_tokens"]
    ll = s["llama8b_batch1"]
    assert ll["tok_s"] > 0 and 0 < ll["mbu_vs_copy"] and ll["bytes_per_decode_step"] > 0
    lf = s["llama8b_formats"]["formats"]
    assert list(lf) == ["bfloat16", "int8", "int4"]
    assert all(r["tok_s"] > 0 and r["mbu_vs_copy"] > 0 for r in lf.values())
    # fewer bytes per step, as stored: int4 < int8 < bfloat16
    b = [lf[k]["bytes_per_decode_step"] for k in lf]
    assert b[2] < b[1] < b[0]
    en = s["engine_throughput"]
    assert en["finished_all"] and en["completed_requests"] == en["requests"] == 8
    assert en["output_tokens"] == en["total_output_tokens_planned"] and en["output_tok_s"] > 0
    # the engine's CUDA-graph path ran (eagerly, on the CPU): decode steps went through fixed-shape steps
    assert (
        en["cuda_graphs"] is False
        and en["graphs_captured"] > 0
        and en["fixed_shape_decode_steps"] > 0
    )
    # int8 and int4 greedy tokens compared with bfloat16's, from the first token on
    assert lf["bfloat16"]["leading_tokens_as_bfloat16"] == s["llama8b_formats"]["new_tokens"]
    assert all(0 <= r["leading_tokens_as_bfloat16"] <= 16 for r in lf.values())
    pk = s["paged_kernel"]  # the kernel in the gather path's place, equal on the same inputs
    assert pk["agree"] and pk["kernel"]["ms"] > 0 and pk["gather"]["ms"] > 0
    sweep = s["serve_sweep"]["levels"]  # through the real server, rate by rate
    assert [m["request_rate"] for m in sweep] == [4.0, float("inf")]
    assert all(m["completed"] == 8 and m["p99_ttft_ms"] > 0 and m["p50_tpot_ms"] > 0 for m in sweep)
    assert all("p99_itl_ms" in m for m in sweep)
    tp = s["tensor_parallel"]  # the same section on CPU processes with gloo
    assert tp["tokens_equal_fp32"] and tp["weights_are_shards"] and tp["blocks_returned"]
    assert tp["tpN_fp32"]["ranks"][1]["allreduce_calls"] > 0
    print(f"gpu_check --dry-run: {wall:.1f} s wall")
    assert wall < 240  # well under a minute on an idle 2-core machine; generous for a busy one
