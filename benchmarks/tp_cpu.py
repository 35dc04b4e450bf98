"""Tensor parallelism on this CPU: the split engine against the unsplit one, in the same run.

    bench-run python benchmarks/tp_cpu.py --out results/cpu/tp.json

For SmolLM2 (GGUF) at TP = 3 and a random Llama-shaped checkpoint at TP = 2 (GQA, untied): greedy
tokens of both, the largest difference of any step's logits (absolute, and relative to that
step's largest logit), every rank's resident weight bytes against its shard and the whole model,
its KV blocks after the run, the share of its step time spent in all-reduce, and the split
engine's time per step over the unsplit one's (the ratio is the result; on a shared CPU the
ranks compete for the cores, so it says nothing about GPUs: chapter 11 puts it beside
``llmlib.analysis.capacity``'s figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llmlib  # noqa: E402
from llmlib.checkpoints.save import save_hf_folder  # noqa: E402
from llmlib.config import ModelConfig  # noqa: E402
from llmlib.device import machine_info  # noqa: E402
from llmlib.model import random_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "A haiku about memory bandwidth:\n",
    "def fibonacci(n):",
    "Three facts about the moon:\n1.",
]
TINY = ModelConfig(
    name="tiny-gqa-untied",
    vocab_size=300,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=128,
)


def _record(llm: llmlib.LLM) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    forward = llm.runner._forward

    def spy(chunks, select):
        out = forward(chunks, select)
        seen.append(out.detach().clone())
        return out

    llm.runner._forward = spy
    return seen


def compare(path: Path, tp: int, prompts: list, params: llmlib.SamplingParams, **kw) -> dict:
    ref = llmlib.LLM(path, **kw)
    ref_logits = _record(ref)
    t0 = time.perf_counter()
    ref_out = ref.generate(prompts, params, use_tqdm=False)
    ref_s = time.perf_counter() - t0
    ref_steps = ref.stats().steps
    del ref
    with llmlib.LLM(path, tensor_parallel_size=tp, **kw) as llm:
        logits = _record(llm)
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        tp_s = time.perf_counter() - t0
        steps = llm.stats().steps
        reports = llm.tensor_parallel_report()
    diffs = [(a - b).abs().max().item() for a, b in zip(logits, ref_logits)]
    rel = [d / b.abs().max().item() for d, b in zip(diffs, ref_logits)]
    return {
        "tp": tp,
        "tokens_identical": [o.token_ids for o in out] == [o.token_ids for o in ref_out],
        "forward_passes": len(logits),
        "max_abs_logit_diff": max(diffs),
        "max_rel_logit_diff": max(rel),
        "seconds_per_step_tp1": ref_s / ref_steps,
        "seconds_per_step_tpN": tp_s / steps,
        "tpN_over_tp1_step_time": (tp_s / steps) / (ref_s / ref_steps),
        "ranks": [
            {
                "rank": r.rank,
                "weight_bytes": r.weight_bytes,
                "shard_bytes": r.shard_bytes,
                "model_bytes": r.model_bytes,
                "share_of_model": r.weight_bytes / r.model_bytes,
                "replicated_bytes": r.replicated_bytes,
                "pool_bytes": r.pool_bytes,
                "held_blocks_after": r.held_blocks,
                "rss_bytes": r.rss_bytes,
                "steps": r.steps,
                "allreduce_calls": r.allreduce_calls,
                "allreduce_share": r.allreduce_share,
            }
            for r in reports
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)
    from llmlib.checkpoints.fetch import fetch_model

    greedy = llmlib.SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    res = {"machine": machine_info(torch.device("cpu")), "threads": torch.get_num_threads()}
    res["smollm2_tp3"] = compare(fetch_model(quiet=True), 3, PROMPTS, greedy, max_num_seqs=32)
    with tempfile.TemporaryDirectory() as d:
        model = random_model(TINY, "cpu", torch.float32, seed=7, std=0.15)
        save_hf_folder(model, d)
        ids = [[5 + i for i in range(n)] for n in (24, 2, 18, 1, 40, 7)]
        params = llmlib.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        kw = dict(num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
        res["tiny_tp2"] = compare(Path(d), 2, ids, params, **kw)
    text = json.dumps(res, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    ok = all(res[k]["tokens_identical"] for k in ("smollm2_tp3", "tiny_tp2"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
