"""The product path before and after a change, in two checkouts, taking turns in one session.

For each round, each checkout runs ``llmlib bench generate --formats ...`` (batch 1, every format
compiled as ``llmlib generate`` runs it by default; one process per checkout and round) and
``llmlib bench batching`` (the default format: sequential, static and continuous batching). The
checkouts alternate, so a drift of the machine shows in both. Reported: per format, the median
decode tokens/s of each checkout and their ratio (after over before), and the same for the
batching modes' output tokens/s.

    python benchmarks/product_path_ab.py --before /tmp/old-clone --after . --out results/cpu/X.json

Each checkout's own ``llmlib`` is imported (the commands run with the checkout as their folder),
with the same interpreter, threads and compiled-step cache (their keys differ where the code
does). Set the class variables (``LLMLIB_AS_CPU`` and the rest, see the Makefile) to run as
another CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = "float32+compile,bfloat16+compile,int8+compile,int4+compile,gguf+compile"


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--", "llmlib"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def _bench(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "llmlib", "bench", *args, "--json"]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {tree}: {out.stderr[-3000:]}")
    text = out.stdout
    return json.loads(text[text.index("{") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-batching", action="store_true", help="only the batch-1 formats")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    gen_args = [
        "generate", "--formats", args.formats, "--threads", str(args.threads),
        "--new-tokens", str(args.new_tokens), "--runs", "1", "--no-llama-cpp", "--no-memory",
    ]  # fmt: skip
    bat_args = ["batching", "--threads", str(args.threads), "--num-requests", "32"]
    decode: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    prefill: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    paths: dict[str, dict[str, str]] = {s: {} for s in sides}
    batching: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    for r in range(args.rounds):
        for side, tree in sides.items():
            res = _bench(tree, gen_args)
            for f in res["formats"]:
                decode[side].setdefault(f["name"], []).append(f["tokens_per_s"])
                prefill[side].setdefault(f["name"], []).append(f["prefill_s"])
                paths[side][f["name"]] = f.get("decode_path", "")
            line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in decode[side].items())
            print(f"round {r + 1} {side}: {line}", file=sys.stderr, flush=True)
            if not args.no_batching:
                b = _bench(tree, bat_args)
                for mode, tps in b["tokens_per_s"].items():
                    batching[side].setdefault(mode, []).append(tps)
                line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in batching[side].items())
                print(f"round {r + 1} {side} batching: {line}", file=sys.stderr, flush=True)
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in decode.items()}
    out = {
        "commits": {s: _commit(t) for s, t in sides.items()},
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "decode_tokens_per_s": decode,
        "prefill_s": prefill,
        "decode_paths": paths,
        "median_tokens_per_s": med,
        "ratio_after_over_before": {
            k: round(med["after"][k] / med["before"][k], 3) for k in med["before"]
        },
    }
    if not args.no_batching:
        bmed = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in batching.items()}
        out["batching_tokens_per_s"] = batching
        out["batching_median_tokens_per_s"] = bmed
        out["batching_ratio_after_over_before"] = {
            k: round(bmed["after"][k] / bmed["before"][k], 3) for k in bmed["before"]
        }
    from llmlib.device import machine_info

    out["machine"] = machine_info("cpu")
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
