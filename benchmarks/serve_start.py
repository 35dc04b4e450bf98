"""Seconds from starting ``llmlib serve`` to ``/health`` answering, run as each class of CPU.

    python benchmarks/serve_start.py --classes own,avx2,zen4 --out results/cpu/serve_start_as.json

Per class, the server starts with its default path (the engine's step compiled on a CPU):
once with empty caches (llmlib's and inductor's, in a temporary folder: the first start on a
machine, which compiles), then ``--warm`` times more on those caches (later starts, which load
the package), and once with ``--no-compile``. Issue 34 asks for ``/health`` within 10 s of a warm
start, compiled or not. The server binds 127.0.0.1 on a free port and is stopped after each
start; one runs at a time. A class other than ``own`` takes that class's code paths on this CPU
(:data:`llmlib.kernels.flags.CLASSES`), not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def started(extra: list[str], env: dict[str, str]) -> float:
    """Seconds from starting one server with ``env`` set to its first 200 on /health."""
    from llmlib.bench.serve import ServerProcess

    server = ServerProcess(extra=extra, env=env)
    t0 = time.perf_counter()
    try:
        server.start(timeout=900)
        return round(time.perf_counter() - t0, 2)
    finally:
        server.stop()


def run_one(name: str, warm: int, log=print) -> dict:
    from llmlib.kernels.flags import class_env

    env = {} if name == "own" else class_env(name)
    record = dict(env)
    with tempfile.TemporaryDirectory(prefix=f"serve-start-{name}-") as tmp:
        env |= {"LLMLIB_CACHE": tmp, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        cold = started([], env)
        log(f"{name}: cold {cold} s")
        warms = [started([], env) for _ in range(warm)]
        log(f"{name}: warm {warms} s")
        eager = started(["--no-compile"], env)
        log(f"{name}: --no-compile {eager} s")
    return {"env": record, "cold_s": cold, "warm_s": warms, "no_compile_s": eager}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="own", help="comma list of own, avx2, zen4")
    ap.add_argument("--warm", type=int, default=2, help="warm starts per class")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ.pop("LLMLIB_COMPILE", None)  # the servers get the default a user gets
    from llmlib.device import machine_info

    res = {
        "machine": machine_info("cpu"),
        "command": "llmlib serve --port PORT [--no-compile], polled on /health every 0.25 s",
        "model": "the default (SmolLM2-135M-Instruct Q4_1 GGUF), serve's default format",
        "classes": {},
    }
    for name in args.classes.split(","):
        res["classes"][name] = run_one(name, args.warm)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
