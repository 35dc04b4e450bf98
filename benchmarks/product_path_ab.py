"""Batch-1 decode of the product path before and after a change: two checkouts, interleaved.

For each format, one worker process per checkout loads SmolLM2 in that format and builds what
``llmlib generate`` runs there (before the one-engine change: the ``Generator`` with its compiled
decode step; after: ``LLM(..., max_num_seqs=1)``, the engine with one sequence, its step
compiled). Then the two workers take turns, one greedy request of ``--new-tokens`` each, ``--pairs``
times: the machine's drift (it moves by 10-20% over minutes here) falls on both sides alike, where
a run of one checkout after the other would measure the drift. Each request is timed by the wall
clock from its first token to the call's return, the loop's own bookkeeping included, as a user
waits for it. The workers start one after the other: a step compiled at start is tuned by timing
its kernels (``max_autotune``), and two compiles at once would tune each under the other's load.
Reported per format: the median decode tokens/s of each side, the median of the per-pair ratios
(after over before), and the share of pairs the after side won.

``--batching`` also runs ``llmlib bench batching`` (the default format) in each checkout, in turn,
``--rounds`` times.

    python benchmarks/product_path_ab.py --before /tmp/old-clone --after . --out results/X.json

Each checkout's own ``llmlib`` is imported (``PYTHONPATH``); same interpreter, threads and
compiled-step cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = {  # name -> (dtype, quantization)
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": (None, "int8"),
    "int4": (None, "int4"),
    "gguf": (None, "gguf"),
}

_WORKER = r"""
import sys, time, torch, llmlib
from llmlib.checkpoints import resolve_model_path
from llmlib.device import pick_dtype
torch.set_num_threads(int(sys.argv[3]))
path = resolve_model_path(None)
dtype = sys.argv[1] if sys.argv[1] != "None" else str(pick_dtype("cpu", None, sys.argv[2]))
q = None if sys.argv[2] == "None" else sys.argv[2]
model = llmlib.load_model(path, "cpu", dtype.removeprefix("torch."), q)
tok = llmlib.load_tokenizer(path)
n = int(sys.argv[4])
chat = "<|im_start|>user\nWhat is a quadratic equation?<|im_end|>\n<|im_start|>assistant\n"
ids = tok.encode(chat, allowed_special="all")
try:
    from llmlib.engine import fixed_step  # noqa: F401  (the engine is the product path)
    llm = llmlib.LLM(model, tok, max_num_seqs=1, compile=True)
    sp = llmlib.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    path_name = "engine, one sequence: " + llm.runner.decode_path
    def once():
        m = llm.generate([ids], sp, use_tqdm=False)[0].metrics
        return (time.perf_counter() - m.first_token_time) / (n - 1)
except ImportError:  # before: the Generator's compiled decode step
    gen = llmlib.Generator(model, tok, compile=True)
    path_name = "Generator: " + gen.decode_path
    def once():
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=n, ignore_eos=True)
        return (time.perf_counter() - t0 - out.timing.prefill_s) / (n - 1)
once(); once()
print("ready", path_name, flush=True)
for line in sys.stdin:
    print(once(), flush=True)
"""


def _worker(tree: Path, name: str, threads: int, new_tokens: int) -> subprocess.Popen:
    dtype, q = FORMATS[name]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [str(dtype), str(q), str(threads), str(new_tokens)]
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, *args],
        cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _ask(p: subprocess.Popen) -> float:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("run\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batching", action="store_true", help="llmlib bench batching too")
    ap.add_argument("--rounds", type=int, default=3, help="with --batching: turns each")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    out: dict = {
        "commits": {s: _commit(t) for s, t in sides.items()},
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "pairs": args.pairs,
        "formats": {},
    }
    for name in args.formats.split(","):
        # one side at a time up to "ready": a step compiled now is tuned by timing its kernels,
        # and two compiles at once would tune each under the other's load
        workers, paths = {}, {}
        for s, t in sides.items():
            workers[s] = _worker(t, name, args.threads, args.new_tokens)
            paths[s] = workers[s].stdout.readline().strip().removeprefix("ready ")
        secs: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(args.pairs):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # who goes first alternates
            for s in order:
                secs[s].append(_ask(workers[s]))
        for w in workers.values():
            w.stdin.close()
            w.wait()
        ratios = [b / a for a, b in zip(secs["after"], secs["before"])]  # speed: after / before
        tps = {s: round(1 / statistics.median(v), 2) for s, v in secs.items()}
        out["formats"][name] = {
            "paths": paths,
            "seconds_per_token": {s: [round(x, 6) for x in v] for s, v in secs.items()},
            "median_tokens_per_s": tps,
            "median_pair_ratio": round(statistics.median(ratios), 3),
            "after_won": f"{sum(r > 1 for r in ratios)}/{len(ratios)}",
        }
        print(f"{name}: before {tps['before']} tok/s, after {tps['after']} tok/s, median pair "
              f"ratio {statistics.median(ratios):.3f}, after won {sum(r > 1 for r in ratios)}"
              f"/{len(ratios)}", file=sys.stderr, flush=True)  # fmt: skip
    if args.batching:
        got: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
        for _ in range(args.rounds):
            for s, tree in sides.items():
                cmd = [sys.executable, "-m", "llmlib", "bench", "batching", "--threads",
                       str(args.threads), "--num-requests", "32", "--json"]  # fmt: skip
                env = {**os.environ, "PYTHONPATH": str(tree)}
                r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
                res = json.loads(r.stdout[r.stdout.index("{") :])
                for mode, v in res["tokens_per_s"].items():
                    got[s].setdefault(mode, []).append(v)
        med = {s: {m: statistics.median(v) for m, v in d.items()} for s, d in got.items()}
        out["batching_tokens_per_s"] = got
        out["batching_ratio_after_over_before"] = {
            m: round(med["after"][m] / med["before"][m], 3) for m in med["before"]
        }
        print(f"batching: {out['batching_ratio_after_over_before']}", file=sys.stderr)
    from llmlib.device import machine_info

    out["machine"] = machine_info("cpu")
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
