"""``llmlib bench roofline``: this machine's ceilings, and llmlib's own prefill and decode placed under them.

It measures the machine (:func:`llmlib.analysis.roofline.measure_machine`), then times llmlib's model on real
work: SmolLM2-135M (the GGUF, loaded by :func:`llmlib.load_model`) and a larger preset shape with
random weights (Llama-3.2-1B's layer shape, its depth cut so a CPU finishes quickly). For each it
runs prefill at several prompt lengths and one decode step at several batch sizes, and prints the
roofline's predicted time next to the measured median, with the achieved fraction of peak FLOP/s
(MFU) and of peak bandwidth (MBU).

A third, tiny model with SmolLM2's depth but almost no width measures what a forward pass costs
when there is nearly nothing to compute or read: the fixed per-step overhead of Python and kernel
launches, which the roofline does not know about and which dominates small decode steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch

from llmlib.analysis.roofline import Roof, fmt_si, measure_machine, phase, predict
from llmlib.config import ModelConfig, get_config
from llmlib.device import time_fn, timings
from llmlib.dtypes import canonical
from llmlib.kernels.modules import parameter_count


@dataclass(frozen=True)
class Point:
    """One measured pass: what the roofline predicted and what the clock said."""

    model: str
    kind: str  # "prefill" | "decode"
    batch: int
    tokens: int
    context: int
    flops: float
    bytes: float
    intensity: float
    predicted_s: float
    bound: str
    measured_s: float
    mfu: float
    mbu: float

    @property
    def ratio(self) -> float:
        """Measured over predicted (1.0 = on the roof)."""
        return self.measured_s / self.predicted_s


def _make_cache(
    cfg: ModelConfig, batch: int, context: int, device: torch.device, dtype: torch.dtype
) -> Any:
    """A static KV cache already holding ``context`` tokens per row (random keys and values: the time of
    attention does not depend on what they are)."""
    from llmlib.model.kv_cache import KVCache

    cache = KVCache.from_config(cfg, batch=batch, max_len=context + 1, device=device, dtype=dtype)
    cache.k.normal_()
    cache.v.normal_()
    cache.length = context
    return cache


@torch.inference_mode()
def time_prefill(
    model: torch.nn.Module, tokens: int, batch: int = 1, reps: int = 3, warmup: int = 1
) -> float:
    """Median seconds of a prefill of ``tokens`` tokens per row (no cache, logits for the last position)."""
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device=model.device)
    return time_fn(lambda: model(ids, last_only=True), model.device, warmup, reps, budget_s=1.5)


@torch.inference_mode()
def time_decode(
    model: torch.nn.Module, batch: int = 1, context: int = 64, reps: int = 5, warmup: int = 2
) -> float:
    """Median seconds of one decode step: ``batch`` new tokens, each after ``context`` cached ones."""
    return time_fn(_decode_step(model, batch, context), model.device, warmup, reps, budget_s=1.5)


def weight_stream(model: torch.nn.Module, batch: int = 1) -> tuple[Any, int]:
    """A function that multiplies a ``batch``-row input by every weight matrix a decode step uses (each
    layer's matrices, then the LM head, which is the embedding table when tied), back to back with no
    model code in between; and the bytes of those matrices. Its time is the matmul kernels' own share
    of a decode step: its gap to the roofline is kernel efficiency, its gap to the real step is the rest."""
    import torch.nn.functional as F

    from llmlib.kernels.prepare import read_bytes, weight_matrices

    # every product weight in the order a step reads them; dense or packed (int8/int4 codes)
    mats = [m.weight for m in weight_matrices(model).values()]
    xs = {
        k: torch.randn(batch, k, device=model.device, dtype=model.dtype)
        for k in {w.shape[1] for w in mats}
    }

    def stream() -> None:
        for w in mats:
            x = xs[w.shape[1]]
            F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)

    nbytes = sum(read_bytes(w) for w in mats)
    return stream, nbytes


@torch.inference_mode()
def time_weight_stream(
    model: torch.nn.Module, batch: int = 1, reps: int = 5, warmup: int = 2
) -> tuple[float, int]:
    """Median seconds of :func:`weight_stream`, and its bytes."""
    stream, nbytes = weight_stream(model, batch)
    return time_fn(stream, model.device, warmup, reps, budget_s=1.5), nbytes


def _decode_step(model: torch.nn.Module, batch: int, context: int) -> Any:
    """A function running one decode step of ``batch`` rows after ``context`` cached tokens, rewinding
    the cache each time so every call is the same step."""
    cache = _make_cache(model.config, batch, context, model.device, model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    pos = torch.full((batch, 1), context, device=model.device)

    def step() -> torch.Tensor:
        cache.length = context
        return model(ids, positions=pos, cache=cache)

    return step


@torch.inference_mode()
def decode_breakdown(
    model: torch.nn.Module, skeleton: torch.nn.Module, context: int = 64, reps: int = 7
) -> dict[str, float]:
    """Batch-1 decode step of ``model``, its weight matrices alone (:func:`weight_stream`), and
    ``skeleton``'s step, timed in turn within each repetition so all three see the same load on a
    shared machine; medians, plus the matrices' bytes."""
    stream, nbytes = weight_stream(model, 1)
    fns = {
        "step_s": _decode_step(model, 1, context),
        "stream_s": stream,
        "overhead_s": _decode_step(skeleton, 1, context),
    }
    for fn in fns.values():
        timings(fn, model.device, warmup=2, reps=0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            times[k] += timings(fn, model.device, warmup=0, reps=1)
    return {**{k: statistics.median(v) for k, v in times.items()}, "stream_bytes": float(nbytes)}


def measure_points(
    model: torch.nn.Module,
    roof: Roof,
    prefill_lengths: tuple[int, ...] = (16, 64, 256),
    decode_batches: tuple[int, ...] = (1, 4, 16, 64),
    context: int = 64,
    reps: int = 3,
    label: str | None = None,
) -> list[Point]:
    """Time ``model``'s prefills and decode steps and set each beside the roofline's prediction on ``roof``."""
    cfg, dt = model.config, canonical(model.dtype)
    out = []
    jobs = [("prefill", 1, t, 0) for t in prefill_lengths] + [
        ("decode", b, 1, context) for b in decode_batches
    ]
    for kind, b, t, ctx in jobs:
        ph = phase(cfg, kind, tokens=t, batch=b, context=ctx, dtype=dt, last_only=kind == "prefill")
        if kind == "prefill":
            sec = time_prefill(model, t, b, reps=reps)
        else:
            sec = time_decode(model, b, ctx, reps=max(reps, 5))
        p = predict(ph, roof)
        out.append(
            Point(
                label or cfg.name,
                kind,
                b,
                t,
                ctx,
                ph.flops,
                ph.bytes,
                ph.intensity,
                p.time,
                p.bound,
                sec,
                p.mfu(sec),
                p.mbu(sec),
            )
        )
    return out


def overhead_model(like: ModelConfig) -> ModelConfig:
    """A model with ``like``'s depth and next to no width: its decode step is almost pure overhead."""
    return like.replace(
        name=f"{like.name}-skeleton",
        d_model=64,
        n_heads=1,
        n_kv_heads=1,
        head_dim=64,
        ffn_dim=64,
        vocab_size=256,
    )


def run(
    device: Any = None,
    quick: bool = False,
    model_path: str | None = None,
    large: str = "llama-3.2-1b",
    large_layers: int = 2,
    context: int = 64,
    prefill_lengths: tuple[int, ...] | None = None,
    decode_batches: tuple[int, ...] | None = None,
    large_decode_batches: tuple[int, ...] | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure the machine and llmlib's model on it; return everything as plain data.

    ``threads`` sets ``torch.set_num_threads`` for the whole run (ceilings and model alike, so they
    stay comparable). On a CPU shared with other jobs, one thread is far steadier: a multi-threaded
    kernel waits at every barrier for its slowest thread, and a descheduled thread stalls them all.
    """
    if threads:
        torch.set_num_threads(int(threads))
    from llmlib.checkpoints import load_model, resolve_model_path
    from llmlib.device import machine_info, pick_device
    from llmlib.model import random_model

    dev = pick_device(device)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    say("measuring the machine's ceilings ...")
    ceil = measure_machine(dev, reps=3 if quick else 5)
    model_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    roof = ceil.roof(canonical(model_dtype))
    prefill_lengths = prefill_lengths or ((8, 32) if quick else (8, 32, 128))
    decode_batches = decode_batches or ((1, 16) if quick else (1, 4, 16, 64))
    large_decode_batches = large_decode_batches or ((1,) if quick else (1, 8))
    if dev.type == "cuda":
        prefill_lengths = tuple(sorted(set(prefill_lengths) | {512, 2048, 8192}))
        decode_batches = tuple(sorted(set(decode_batches) | {256, 1024}))
        large_decode_batches = decode_batches

    say("loading SmolLM2-135M ...")
    small = load_model(resolve_model_path(model_path), device=dev, dtype=model_dtype)
    points = measure_points(
        small, roof, prefill_lengths, decode_batches, context, reps=3, label="smollm2-135m"
    )
    skeleton = random_model(overhead_model(small.config), device=dev, dtype=model_dtype)
    bd = decode_breakdown(small, skeleton, context, reps=5 if quick else 9)
    params = parameter_count(small)
    del small

    big_cfg = get_config(large)
    if dev.type != "cuda" and large_layers:
        big_cfg = big_cfg.replace(
            n_layers=min(large_layers, big_cfg.n_layers), name=f"{big_cfg.name}-{large_layers}L"
        )
    say(f"building {big_cfg.name} with random weights ...")
    big = random_model(big_cfg, device=dev, dtype=model_dtype)
    points += measure_points(
        big,
        roof,
        prefill_lengths[:2] if dev.type != "cuda" else prefill_lengths,
        large_decode_batches,
        context,
        reps=3,
        label=big_cfg.name,
    )
    del big
    return {
        "machine": machine_info(dev),
        "ceilings": ceil.as_dict(),
        "roof": {
            "name": roof.name,
            "peak_flops": roof.peak_flops,
            "bandwidth": roof.bandwidth,
            "ridge": roof.ridge,
        },
        "dtype": canonical(model_dtype),
        "threads": torch.get_num_threads(),
        "context": context,
        "overhead_s": bd["overhead_s"],
        "stream_s": bd["stream_s"],
        "stream_bytes": int(bd["stream_bytes"]),
        "decode1_s": bd["step_s"],
        "smollm2_params": params,
        "overhead_model": overhead_model(get_config("smollm2-135m")).name,
        "points": [{**p.__dict__, "ratio": p.ratio} for p in points],
    }


def format_report(r: dict[str, Any]) -> str:
    c = r["ceilings"]
    lines = [f"machine: {c['device_name']} ({c['device']})"]
    for d, f in c["matmul_flops"].items():
        lines.append(
            f"  matmul {d:<9} {fmt_si(f, 'FLOP/s'):>14}  (median, {c['matmul_n']}x{c['matmul_n']})"
        )
    lines.append(
        f"  read bandwidth   {fmt_si(c['bandwidth'], 'B/s'):>14}  (median, {c['bandwidth_bytes'] >> 20} MiB buffer)"
    )
    lines.append(f"  torch threads: {r['threads']}")
    lines.append(f"  ridge at {r['dtype']}: {r['roof']['ridge']:.1f} FLOP/byte")
    lines.append(
        f"  fixed cost of one decode step (SmolLM2's 30 layers, no width): {r['overhead_s'] * 1e3:.2f} ms"
    )
    lines.append(
        f"  SmolLM2 decode step at batch 1, timed in turn with the two below: {r['decode1_s'] * 1e3:.2f} ms"
    )
    lines.append(
        f"  SmolLM2's weight matrices alone, batch 1: {r['stream_s'] * 1e3:.2f} ms for "
        f"{r['stream_bytes'] / 1e6:.0f} MB ({fmt_si(r['stream_bytes'] / r['stream_s'], 'B/s')})"
    )
    lines.append("")
    hdr = (
        f"{'model':<18} {'phase':<8} {'B':>3} {'T':>4} {'FLOP/B':>7} {'bound':<8} "
        f"{'predicted':>10} {'measured':>10} {'x':>5} {'MFU':>6} {'MBU':>6}"
    )
    lines += [hdr, "-" * len(hdr)]
    for p in r["points"]:
        lines.append(
            f"{p['model']:<18} {p['kind']:<8} {p['batch']:>3} {p['tokens']:>4} {p['intensity']:>7.1f} {p['bound']:<8} "
            f"{p['predicted_s'] * 1e3:>8.2f}ms {p['measured_s'] * 1e3:>8.2f}ms {p['ratio']:>5.1f} "
            f"{p['mfu']:>6.1%} {p['mbu']:>6.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench roofline", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    ap.add_argument(
        "--model", default=None, help="path to the SmolLM2 GGUF (default: the fetched one)"
    )
    ap.add_argument(
        "--large", default="llama-3.2-1b", help="preset for the larger random-weight model"
    )
    ap.add_argument(
        "--large-layers",
        type=int,
        default=2,
        help="cut the larger model to this many layers on a CPU (0: all)",
    )
    ap.add_argument(
        "--context", type=int, default=64, help="cached tokens per sequence in the decode steps"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the whole run (default: torch's choice)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer points and repetitions")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    try:
        r = run(
            args.device,
            args.quick,
            args.model,
            args.large,
            args.large_layers,
            args.context,
            threads=args.threads,
        )
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"llmlib bench roofline: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
