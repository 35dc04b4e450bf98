"""Loading SmolLM2 from its GGUF file, per format, in two checkouts of the repository: the time of
a load in one process (median of 5 after one to warm up) and the memory of a load in a fresh
process (its resident size after, its peak during; :func:`llmlib.bench.memory.load_memory`).
The two checkouts take turns, twice, so a drift of the machine shows as a spread.

    python benchmarks/load_ab.py --before /tmp/old-clone --after . --out results/cpu/X.json

Each checkout's own ``llmlib`` is imported (the scripts run with it as their folder). Set the
class variables (``LLMLIB_AS_CPU`` and the rest, see the Makefile) to run as another CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = ["int8", "int4", "gguf", "none"]  # none: float32

_TIME = r"""
import sys, time, statistics
from llmlib.checkpoints.build import load_model
from llmlib.checkpoints.fetch import fetch_model
p = fetch_model(quiet=True)
q = None if sys.argv[1] == "none" else sys.argv[1]
load_model(p, quantization=q)
ts = []
for _ in range(5):
    t = time.perf_counter()
    m = load_model(p, quantization=q)
    ts.append(time.perf_counter() - t)
    del m
print(statistics.median(ts))
"""

_MEMORY = r"""
import sys, json
from llmlib.bench.memory import load_memory
from llmlib.checkpoints.fetch import fetch_model
q = None if sys.argv[1] == "none" else sys.argv[1]
print(json.dumps(load_memory(fetch_model(quiet=True), "float32", q, threads=2)))
"""


def _run(code: str, fmt: str, tree: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code, fmt], cwd=tree, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict = {}
    for _ in range(args.rounds):
        for side, tree in trees.items():
            for fmt in FORMATS:
                seconds = float(_run(_TIME, fmt, tree))
                mem = json.loads(_run(_MEMORY, fmt, tree))
                r = runs.setdefault(side, {}).setdefault(
                    fmt, {"load_s": [], "peak_over_resident": [], "resident_mib": []}
                )
                r["load_s"].append(round(seconds, 3))
                r["peak_over_resident"].append(round(mem["peak"] / mem["rss"], 3))
                r["resident_mib"].append(round(mem["rss"] / 2**20, 1))
                print(side, fmt, r, flush=True)
    ratios = {
        fmt: round(
            statistics.median(runs["after"][fmt]["load_s"])
            / statistics.median(runs["before"][fmt]["load_s"]),
            3,
        )
        for fmt in FORMATS
    }
    print("after / before, load time:", ratios)
    if args.out:
        from llmlib.device import machine_info

        commit = {
            side: subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
            ).stdout.strip()
            for side, tree in trees.items()
        }
        rec = {
            "machine": machine_info("cpu"),
            "what": __doc__.split("\n\n")[0].replace("\n", " "),
            "commits": commit,
            "formats": FORMATS,
            "runs": runs,
            "after_over_before_load_s": ratios,
        }
        args.out.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
