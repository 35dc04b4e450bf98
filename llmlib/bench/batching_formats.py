"""``llmlib bench batching --formats ...``: the batching engine in each weight format, in one run.

Every format (``float32``, ``bfloat16``, ``int8``, ``int4``, ``gguf``, as in ``bench generate
--formats``; ``+compile`` for the compiled engine, ``+invariant`` for batch-invariant mode and
``+invariant+compile`` for that mode compiled, whose rows also give their ratio against the same
format's eager and compiled engines) is loaded from the same file
and serves the same requests through :class:`~llmlib.engine.LLM`. Runs go round-robin over the
formats, so a noisy neighbour slows all alike; medians are reported with ratios against float32
from this run, and the share of greedy tokens that equal float32's. ``--perplexity-tokens`` adds
each format's perplexity on the book's text (what ``llmlib.device.choose_format`` weighs speed
against).

``--vllm-python PYTHON`` adds the reference users compare with: vLLM's offline engine (run by
that interpreter, in its own environment, on the same float32 weights written as a Hugging Face
folder) on the same token ids, in each of ``--vllm-dtypes``, bound to the same number of cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from llmlib.bench import save_json
from llmlib.bench.formats import format_of, parse_formats
from llmlib.bench.memory import rss_anon

PEER_SCRIPT = Path(__file__).with_name("_vllm_peer.py")


def _token_share(got: list[list[int]], ref: list[list[int]]) -> float:
    """Share of output positions whose greedy token equals the reference's."""
    pairs = [(a, b) for x, y in zip(got, ref) for a, b in zip(x, y)]
    return round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 4)


def run_vllm(
    python: str,
    folder: Path,
    dtype: str,
    requests: list,
    *,
    threads: int,
    repeats: int,
    max_num_seqs: int,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """vLLM's engine on ``requests`` in a child process; ``RuntimeError`` with its log's tail."""
    job = {
        "folder": str(folder),
        "dtype": dtype,
        "requests": [[r.prompt_ids, r.max_tokens] for r in requests],
        "repeats": repeats,
        "max_num_seqs": max_num_seqs,
    }
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"  # the cores llmlib's threads get
    proc = subprocess.run(
        [python, str(PEER_SCRIPT)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"seconds"')]
    if proc.returncode or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"vLLM ({python}, {dtype}) failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def run(
    path: Path,
    formats: list[str],
    requests: list,
    *,
    engine: tuple,
    repeats: int = 3,
    perplexity_tokens: int = 0,
    vllm_python: str | None = None,
    vllm_dtypes: tuple[str, ...] = ("bfloat16",),
    log=print,
) -> dict[str, Any]:
    """``engine``: ``(max_num_seqs, block_size, max_num_batched_tokens, num_blocks)``."""
    import llmlib
    from llmlib.bench._workload import run_continuous
    from llmlib.bench.formats import fp32_copy_check, quality
    from llmlib.device import machine_info

    tok = llmlib.load_tokenizer(path)
    models: dict[str, torch.nn.Module] = {}
    rows: dict[str, dict[str, Any]] = {}
    compiled: set[str] = set()
    invariant: set[str] = set()
    for name in formats:
        base, *modes = name.split("+")
        comp = "compile" in modes
        dtype, q = format_of(base)
        # stored as LLM() stores what it loads (a compiled row has a model of its own: compiling
        # re-stores its matrices for the graph)
        models[name] = m = llmlib.load_model(path, "cpu", dtype, q)
        rows[name] = {"name": name, "dtype": dtype, "quantization": q, "compiled": comp}
        if comp:
            compiled.add(name)
        if "invariant" in modes:
            invariant.add(name)
            rows[name]["batch_invariant"] = True
        before = rss_anon()
        warm = run_continuous(  # warm up (and compile)
            m, tok, requests[:4], *engine, compile=comp, batch_invariant=name in invariant
        )
        if comp:  # compile_s None: the step came from its package on disk
            rows[name]["decode_path"] = warm["decode_path"]
            rows[name]["compile_s"] = warm["compile_s"] and round(warm["compile_s"], 1)
            grown = rss_anon()
            if before is not None and grown is not None:  # the constants the frozen graph owns
                rows[name]["compile_resident_bytes"] = grown - before
        rows[name]["weight_format"] = fmt = getattr(m, "weight_format", dtype)
        how = f", {warm['decode_path']}" if comp else ""
        if comp and warm["compile_s"] is not None:
            how += f", compiled in {warm['compile_s']:.0f} s"
        log(f"loaded {name}: {fmt}{how}")
    total = sum(r.max_tokens for r in requests)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in models}
    for i in range(repeats):
        for name, m in models.items():
            runs[name].append(
                run_continuous(
                    m,
                    tok,
                    requests,
                    *engine,
                    compile=name in compiled,
                    batch_invariant=name in invariant,
                )
            )
        log(
            f"run {i + 1}/{repeats}: "
            + ", ".join(f"{k} {total / v[-1]['seconds']:.1f}" for k, v in runs.items())
            + " tok/s"
        )
    ref_name = "float32" if "float32" in runs else formats[0]
    ref = runs[ref_name][-1]["outputs"]
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["seconds"])[(len(rs) - 1) // 2]
        rows[name]["continuous_tokens_per_s"] = round(total / med["seconds"], 2)
        rows[name]["seconds_all_runs"] = [round(r["seconds"], 3) for r in rs]
        rows[name][f"same_tokens_as_{ref_name}"] = _token_share(rs[-1]["outputs"], ref)
        if name == "float32":
            rows[name]["fp32_onednn_copy"] = fp32_copy_check(
                run_continuous, models[name], tok, requests, med, *engine, log=log
            )
    base = rows[ref_name]["continuous_tokens_per_s"]
    for r in rows.values():
        r[f"vs_{ref_name}"] = round(r["continuous_tokens_per_s"] / base, 3)
    for name in invariant:  # the mode's price against the same format's default engine
        fmt = name.partition("+")[0]  # (eager and compiled, whichever ran)
        for key, other in (("vs_eager", fmt), ("vs_compiled", fmt + "+compile")):
            if other in rows:
                got, ref_tps = rows[name], rows[other]["continuous_tokens_per_s"]
                got[key] = round(got["continuous_tokens_per_s"] / ref_tps, 3)
    if perplexity_tokens:  # eager rows: a compiled row's prefill and graph hold the same weights
        quality(
            {k: m for k, m in models.items() if k not in compiled},
            tok,
            perplexity_tokens,
            rows,
            log,
        )
    peers = []
    if vllm_python:
        fp32 = models.get("float32") or llmlib.load_model(path, "cpu", "float32", None)
        with tempfile.TemporaryDirectory(prefix="llmlib-vllm-") as tmp:
            from llmlib.checkpoints.save import save_hf_folder

            folder = save_hf_folder(fp32, tmp)
            for dt in vllm_dtypes:
                out = run_vllm(
                    vllm_python,
                    folder,
                    dt,
                    requests,
                    threads=torch.get_num_threads(),
                    repeats=repeats,
                    max_num_seqs=engine[0],
                )
                tps = total / statistics.median(out["seconds"])
                peer = {
                    "name": f"vllm {dt}",
                    "version": out["version"],
                    "dtype": dt,
                    "tokens_per_s": round(tps, 2),
                    "seconds_all_runs": [round(s, 3) for s in out["seconds"]],
                    f"same_tokens_as_{ref_name}": _token_share(out["outputs"], ref),
                }
                for key, label in ((dt, "llmlib_vs_vllm"), (dt + "+compile", "compiled_vs_vllm")):
                    mine = rows.get(key)
                    if mine is not None:
                        peer[label] = float(f"{mine['continuous_tokens_per_s'] / tps:.4g}")
                peers.append(peer)
                log(f"vLLM {out['version']} {dt}: {tps:.1f} tok/s")
    return {
        "machine": machine_info("cpu"),
        "model": path.name,
        "threads": torch.get_num_threads(),
        "num_requests": len(requests),
        "output_tokens": total,
        "repeats": repeats,
        "engine": dict(zip(("max_num_seqs", "block_size", "max_num_batched_tokens"), engine)),
        "formats": list(rows.values()),
        "peers": peers,
    }


def print_table(res: dict[str, Any]) -> None:
    print(
        f"{res['model']}, {res['num_requests']} requests, {res['output_tokens']} output tokens, "
        f"{res['threads']} threads, median of {res['repeats']}"
    )
    w = max(16, *(len(r["name"]) + 2 for r in res["formats"]))
    print(f"{'format':<{w}}{'tok/s':>9}{'x float32':>11}{'tokens = fp32':>15}{'ppl/fp32':>10}")
    for r in res["formats"]:
        ppl, vs, same = (
            r.get(k) for k in ("perplexity_vs_float32", "vs_float32", "same_tokens_as_float32")
        )  # absent without a float32 row: left blank, not printed as zero
        print(
            f"{r['name']:<{w}}{r['continuous_tokens_per_s']:>9.1f}"
            f"{'-' if vs is None else f'{vs:.2f}':>11}{'-' if same is None else f'{same:.1%}':>15}"
            f"{'' if ppl is None else f'{ppl:.4f}':>10}"
        )
    for r in res["formats"]:  # the batch-invariant mode's price, against the same format
        fmt = r["name"].partition("+")[0]
        ratios = [
            f"{r[k]:.2f}x {fmt}{suffix}"
            for k, suffix in (("vs_compiled", "+compile"), ("vs_eager", ""))
            if k in r
        ]
        if ratios:
            print(f"{r['name']}: " + ", ".join(ratios))
    for p in res["peers"]:
        dt = p["dtype"]
        vs = [
            f"llmlib {name} / vLLM {dt}: {p[k]:.2f}x"
            for k, name in (("llmlib_vs_vllm", dt), ("compiled_vs_vllm", dt + "+compile"))
            if p.get(k) is not None
        ]
        print(f"{p['name']:<{w}}{p['tokens_per_s']:>9.1f}" + "".join("   " + v for v in vs))


def format_names(text: str) -> list[str]:
    """``--formats`` for the engine (``+compile``: ``LLM(compile=True)``; ``+invariant``:
    ``LLM(batch_invariant=True)``, eager, and ``+invariant+compile`` compiled); a ValueError
    names an unknown one."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.endswith(("+invariant", "+invariant+compile")):
            parse_formats(item.partition("+")[0])  # the format itself must be known
            out.append(item)
        else:
            out += [name + ("+compile" if comp else "") for name, comp in parse_formats(item)]
    return out


def main_formats(ap, args, log) -> int:
    """The ``--formats`` branch of ``llmlib bench batching`` (its parser and parsed arguments)."""
    from llmlib.bench._workload import make_requests
    from llmlib.checkpoints import resolve_model_path
    from llmlib.checkpoints.lazy import read_checkpoint_lazy

    try:
        names = format_names(args.formats)
    except ValueError as e:
        ap.error(f"--formats: {e}")
    path = resolve_model_path(args.model)
    sizes = tuple(args.prompt_len), tuple(args.output_len)
    reqs = make_requests(
        args.num_requests, read_checkpoint_lazy(path)[0].vocab_size, args.seed, *sizes
    )
    engine = (
        args.max_num_seqs,
        args.block_size,
        args.max_num_batched_tokens,
        (args.kv_budget_tokens // args.block_size) if args.kv_budget_tokens else None,
    )
    res = run(
        path,
        names,
        reqs,
        engine=engine,
        repeats=args.repeats,
        perplexity_tokens=args.perplexity_tokens,
        vllm_python=args.vllm_python,
        vllm_dtypes=tuple(args.vllm_dtypes.split(",")),
        log=log,
    )
    res["arguments"] = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
    save_json(res, args.out)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    return 0


def add_formats_args(ap) -> None:
    ap.add_argument("--formats", default=None, help="comma list: run each format, side by side")
    ap.add_argument(
        "--perplexity-tokens", type=int, default=0, help="with --formats: also each's perplexity"
    )
    ap.add_argument("--vllm-python", default=None, help="with --formats: vLLM too, via PYTHON")
    ap.add_argument("--vllm-dtypes", default="bfloat16", help="comma list (default: bfloat16)")
