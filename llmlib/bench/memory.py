"""What loading a model costs in memory: resident after, and the peak on the way, in a fresh
process (the numbers ``llmlib bench generate --formats`` reports and the tests bound).

Only anonymous memory counts (``RssAnon``: what the process allocated). The pages of a
memory-mapped weights file are the kernel's page cache: they show in the total resident size
while a file is read, but they are not the process's, and the kernel drops them under pressure.
The peak is sampled by a thread every couple of milliseconds while the model loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss_anon() -> int | None:
    """This process's resident anonymous memory in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None


class PeakSampler:
    """``with PeakSampler() as p: ...`` then ``p.peak``: the highest :func:`rss_anon` seen."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak = every_s, rss_anon() or 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon() or 0)
            time.sleep(self.every_s)

    def __enter__(self) -> PeakSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon() or 0)


_LOAD = """
import ctypes, gc, json, sys, torch
import llmlib
from llmlib.bench.formats import stored_bytes
from llmlib.bench.memory import PeakSampler, rss_anon
torch.set_num_threads(int(sys.argv[4]))
# what any load imports and builds first (modules, the C++ kernels): not the model's memory
import llmlib.checkpoints.build
from llmlib.runtime.aot import load_kernels
load_kernels()
gc.collect()
before = rss_anon()
with PeakSampler() as p:
    m = llmlib.load_model(sys.argv[1], "cpu", sys.argv[2], None if sys.argv[3] == "-" else sys.argv[3])
    gc.collect()
try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
rope = sum(b.numel() * b.element_size() for b in m.rope.buffers())  # tables, not weights
print(json.dumps({"rss": rss_anon() - before - rope, "peak": p.peak - before - rope,
                  "stored": stored_bytes(m), "format": m.weight_format}))
"""


def load_memory(
    path: Path, dtype: str, quantization: str | None, threads: int = 1, timeout: float = 1800
) -> dict:
    """Load ``path`` in a fresh process: ``{"rss", "peak", "stored", "format"}`` in bytes, the
    resident growth after, its peak during, what the format stores."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), dtype, quantization or "-", str(threads)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"loading {path} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
