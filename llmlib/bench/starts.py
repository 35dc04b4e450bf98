"""How long a user waits for the first token of ``llmlib generate``, cold and warm.

Each format runs ``llmlib generate`` twice in a fresh process, as a user types it, with the
compiled-step cache (:mod:`llmlib.runtime.aot`) pointed at an empty temporary folder: the first
start is cold (it compiles the decode step and stores it; inductor's caches start empty too), the
second is warm (it loads the package). The clock runs from starting the process to the first byte of the answer on its
standard output, so Python's start, the imports, the load, the compile or package load and
prefill all count. At that first byte each process's resident memory is read: its peak so far
and now, mapped file pages included (a quantized model's packed weights are such pages on a warm
start, :mod:`llmlib.checkpoints.packed`). llama.cpp's start is timed the same way: a fresh process that loads the same
file and writes its first token (``llama-cpp-python``, where installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "hi"

#: format -> the ``llmlib generate`` arguments that ask for it
FORMAT_ARGS = {
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "gguf": ["--quantization", "gguf"],
}

_LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch={n_batch}, n_threads={t},
            n_threads_batch={t}, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)
sys.stdout.write(out["choices"][0]["text"] or "?")
sys.stdout.flush()
"""


def resident(pid: int) -> dict[str, int]:
    """A live process's resident memory in bytes (Linux): ``peak_rss`` (``VmHWM``, the most it
    has held) and ``rss`` (``VmRSS``, now), both counting mapped file pages; {} elsewhere."""
    keys = {"VmHWM:": "peak_rss", "VmRSS:": "rss"}
    try:
        with open(f"/proc/{pid}/status") as f:
            return {
                keys[line.split()[0]]: int(line.split()[1]) * 1024
                for line in f
                if line.split() and line.split()[0] in keys
            }
    except OSError:
        return {}


def first_byte_seconds(
    cmd: list[str], env: dict[str, str], timeout: float = 900, memory: dict | None = None
) -> float:
    """Seconds from starting ``cmd`` to the first byte it writes to standard output (the
    process then runs to its end; a failure raises with its standard error). ``memory``: filled
    with the process's :func:`resident` memory at that first byte."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None
    first = p.stdout.read(1)
    seconds = time.perf_counter() - t0
    if memory is not None:
        memory.update(resident(p.pid))
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise RuntimeError(f"{' '.join(cmd[:6])} ...: no end after {timeout:.0f} s") from None
    if p.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {err.decode()[-2000:]}")
    return seconds


def generate_command(path: Path, name: str, compiled: bool) -> list[str]:
    cmd = [sys.executable, "-m", "llmlib", "generate", PROMPT, "--model", str(path)]
    cmd += [*FORMAT_ARGS[name], "--max-new-tokens", "1", "--no-chat", "--quiet"]
    return cmd + ([] if compiled else ["--no-compile"])


def run(
    path: Path, formats: list[tuple[str, bool]], threads: int = 2, llama_cpp: bool = True, log=print
) -> dict[str, Any]:
    """Per format (``(name, compiled)``), the cold and the warm start's seconds to the first token;
    and llama.cpp's, on the file itself."""
    from llmlib.bench import _llama_cpp

    out: dict[str, Any] = {}
    for name, comp in formats:
        label = name + ("+compile" if comp else "")
        with tempfile.TemporaryDirectory(prefix="llmlib-starts-") as cache:
            env = {**os.environ, "LLMLIB_CACHE": cache, "OMP_NUM_THREADS": str(threads)}
            # inductor's own caches too: a cold start is a machine that never compiled this model
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")
            env.pop("LLMLIB_COMPILE", None)  # the default a user gets
            cmd = generate_command(path, name, comp)
            cold = first_byte_seconds(cmd, env)
            mem: dict[str, int] = {}
            warm = [first_byte_seconds(cmd, env, memory=mem) for _ in range(2)]
        out[label] = {"cold_s": round(cold, 2), "warm_s": round(min(warm), 2), **mem}
        log(f"start {label}: first token after {cold:.1f} s cold, {min(warm):.1f} s warm")
    if llama_cpp and _llama_cpp.available():
        cmd = [
            sys.executable,
            "-c",
            _LLAMA_CPP.format(t=threads, n_batch=_llama_cpp.n_batch()),
            str(path),
            PROMPT,
        ]
        env = dict(os.environ)
        mem = {}
        first = [first_byte_seconds(cmd, env, memory=mem) for _ in range(3)]
        out["llama.cpp"] = {"warm_s": round(min(first), 2), **mem}
        log(f"start llama.cpp: first token after {min(first):.1f} s")
    return out
