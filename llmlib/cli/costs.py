"""``llmlib costs``: what a model costs to run, as a table or JSON (:mod:`llmlib.analysis.costs`)."""

from __future__ import annotations

import argparse
import json
import sys

from llmlib.analysis.capacity import Sharding, shard
from llmlib.analysis.costs import Costs, costs
from llmlib.analysis.gpus import GPUS
from llmlib.config import PRESETS, ModelConfig, get_config
from llmlib.dtypes import FLOAT_NAMES, NAMES


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:,.0f} B"


def format_table(c: Costs) -> str:
    """A readable report of :func:`costs`."""
    rows = [
        ("model", f"{c.model}  ({c.dtype} weights, {c.kv_dtype} KV cache)"),
        ("gpu", f"{c.gpu}  (ridge {c.gpu_ridge:,.0f} FLOP/byte)"),
        ("request", f"{c.prompt_tokens} prompt tokens -> {c.output_tokens} output tokens, batch 1"),
        ("", ""),
        ("parameters", f"{c.params_total:,}"),
        ("  embedding", f"{c.params_embedding:,}"),
        (
            "  per layer",
            f"{c.params_per_layer:,}  (attention {c.params_attention_per_layer:,}, FFN {c.params_ffn_per_layer:,})",
        ),
        ("  FFN share of a layer", f"{c.ffn_param_share:.1%}"),
        (
            "  LM head",
            f"{c.params_lm_head:,}"
            + ("  (tied: reads the embedding table)" if c.params_lm_head == 0 else ""),
        ),
        ("weights", _fmt_bytes(c.weight_bytes)),
        ("  embedding table", _fmt_bytes(c.embedding_bytes)),
        ("  one layer", _fmt_bytes(c.bytes_per_layer)),
        ("  LM head (read per step)", _fmt_bytes(c.lm_head_bytes)),
        ("KV cache per token", f"{c.kv_bytes_per_token:,.0f} B"),
        ("  after the prompt", _fmt_bytes(c.prompt_kv_bytes)),
        ("  at the end", _fmt_bytes(c.final_kv_bytes)),
        ("", ""),
        (
            "prefill",
            f"{c.prefill_flops / 1e12:,.2f} TFLOP over {_fmt_bytes(c.prefill_bytes)}: "
            f"{c.prefill_intensity:,.1f} FLOP/byte, {c.prefill_bound}-bound, >= {c.prefill_ms:,.2f} ms",
        ),
        (
            "decode step",
            f"{c.decode_flops_per_token / 1e9:,.1f} GFLOP over {_fmt_bytes(c.decode_bytes_per_token)}: "
            f"{c.decode_intensity:,.2f} FLOP/byte",
        ),
        (
            "decode floor",
            f"{c.decode_ms_per_token:,.2f} ms/token  ({c.decode_tokens_per_s:,.1f} tokens/s)",
        ),
        ("decode total", f"{c.decode_total_s:,.2f} s for {c.output_tokens - 1} steps"),
        (
            "weight traffic",
            f"{_fmt_bytes(c.total_weight_traffic_bytes)}  ({c.output_tokens} passes over the weights)",
        ),
        (
            "request floor",
            f"{c.total_s:,.2f} s"
            + ("" if c.fits_in_gpu_memory else "  (does not fit in one GPU's memory: shard it)"),
        ),
    ]
    return _table(rows)


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" if k else "" for k, v in rows)


def format_sharding(s: Sharding) -> str:
    """A readable report of :func:`llmlib.analysis.capacity.shard`."""
    fit = "fits" if s.fits else "does NOT fit"
    rows = [
        ("", ""),
        ("tensor parallel", f"{s.tp} x {s.gpu}"),
        (
            "weights per GPU",
            f"{_fmt_bytes(s.weight_bytes_per_gpu)}  ({fit} in "
            f"{_fmt_bytes(s.gpu_memory_bytes)} less a {_fmt_bytes(s.reserve_bytes)} reserve)",
        ),
        ("KV cache per token", f"{s.kv_bytes_per_token_per_gpu:,.0f} B per GPU"),
        (
            "KV capacity",
            f"{s.kv_tokens_capacity:,} tokens per GPU: {s.max_batch_at_context:,} "
            f"sequences of {s.context:,} tokens",
        ),
        (
            "all-reduce per token",
            f"{s.allreduce_bytes_per_token_per_layer:,.0f} B a layer, "
            f"{_fmt_bytes(s.allreduce_bytes_per_token)} in all",
        ),
        (
            "decode step floor",
            f"{s.decode_ms_per_step:,.2f} ms at batch {s.batch}, context {s.context:,} "
            f"(weights {s.weight_read_ms:,.2f} + KV {s.kv_read_ms:,.2f} + "
            f"all-reduce {s.allreduce_ms:,.3f} ms; {s.comm_share:.1%} communication)",
        ),
        (
            "with compute",
            f"{s.step_ms:,.2f} ms ({s.bound}-bound; compute {s.compute_ms:,.2f} ms): "
            f"{s.tokens_per_s:,.0f} tokens/s",
        ),
    ]
    return _table(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib costs",
        description="What a model costs to run: parameters, bytes, KV cache, and the decode floor on a GPU.",
    )
    ap.add_argument(
        "--model",
        default="llama-3-70b",
        help=f"preset ({', '.join(PRESETS)}) or a config.json path",
    )
    ap.add_argument("--gpu", default="h100-sxm", choices=list(GPUS))
    ap.add_argument("--prompt-tokens", type=int, default=7)
    ap.add_argument("--output-tokens", type=int, default=184)
    ap.add_argument("--dtype", default="bf16", choices=sorted(NAMES))
    ap.add_argument(
        "--kv-dtype",
        default=None,
        choices=sorted(FLOAT_NAMES),
        help="KV cache dtype (default: the weights' float dtype, else bf16)",
    )
    ap.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel GPUs the model is split over"
    )
    ap.add_argument(
        "--context", type=int, default=8192, help="tokens per sequence for the KV capacity"
    )
    ap.add_argument(
        "--batch", type=int, default=1, help="sequences in the decode step of the floor"
    )
    ap.add_argument(
        "--allreduce-latency-us",
        type=float,
        default=0.0,
        help="per all-reduce latency to add to the bandwidth floor (default 0: the floor)",
    )
    ap.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    args = ap.parse_args(argv)
    try:
        cfg = (
            ModelConfig.from_json(args.model)
            if args.model.endswith(".json")
            else get_config(args.model)
        )
        c = costs(cfg, args.gpu, args.prompt_tokens, args.output_tokens, args.dtype, args.kv_dtype)
        s = shard(
            cfg,
            args.gpu,
            args.tp,
            args.dtype,
            args.kv_dtype,
            args.context,
            args.batch,
            args.allreduce_latency_us * 1e-6,
        )
    except (KeyError, ValueError, OSError) as e:
        print(f"llmlib costs: {e}", file=sys.stderr)
        return 2
    if args.json:
        shared = {"model", "gpu", "dtype", "kv_dtype"}
        print(
            json.dumps(
                {**c.as_dict(), **{k: v for k, v in s.as_dict().items() if k not in shared}},
                indent=2,
            )
        )
    else:
        print(format_table(c) + "\n" + format_sharding(s))
    return 0
