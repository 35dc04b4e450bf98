"""``llmlib bench generate --formats ... --starts``: the seconds from starting a process to the
first token it writes, cold (an empty compiled-step cache) and warm, as a user starts it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from llmlib.bench import starts


def test_first_byte_is_timed_from_the_start_and_failures_say_why() -> None:
    env = dict(os.environ)
    wait = "import time, sys; time.sleep(0.3); print('x', flush=True); time.sleep(0.5)"
    s = starts.first_byte_seconds([sys.executable, "-c", wait], env)
    assert 0.3 <= s < 0.8  # the first byte, not the end of the process
    mem: dict = {}
    starts.first_byte_seconds([sys.executable, "-c", wait], env, memory=mem)
    if os.path.exists("/proc/self/status"):  # Linux: the process's own memory, read at that byte
        assert 0 < mem["rss"] <= mem["peak_rss"] < 1 << 30
    with pytest.raises(RuntimeError, match="boom"):
        starts.first_byte_seconds([sys.executable, "-c", "raise SystemExit('boom')"], env)


def test_each_format_starts_cold_then_warm_in_a_fresh_cache(monkeypatch) -> None:
    seen: list[tuple[list[str], dict]] = []

    def fake(cmd: list[str], env: dict[str, str], timeout: float = 900, memory=None) -> float:
        seen.append((cmd, env))
        return (
            40.0
            if len([c for c, e in seen if e["LLMLIB_CACHE"] == env["LLMLIB_CACHE"]]) == 1
            else 3.0
        )

    monkeypatch.setattr(starts, "first_byte_seconds", fake)
    monkeypatch.setenv("LLMLIB_COMPILE", "0")
    out = starts.run(
        Path("m.gguf"), [("gguf", True), ("float32", False)], llama_cpp=False, log=lambda *_: None
    )
    assert out == {
        "gguf+compile": {"cold_s": 40.0, "warm_s": 3.0},
        "float32": {"cold_s": 40.0, "warm_s": 3.0},
    }
    caches = {env["LLMLIB_CACHE"] for _, env in seen}
    assert len(caches) == 2 and not any(Path(c).exists() for c in caches)  # fresh, removed after
    for cmd, env in seen:
        assert "LLMLIB_COMPILE" not in env  # the default a user gets
        assert cmd[cmd.index("--max-new-tokens") + 1] == "1" and "m.gguf" in cmd
    compiled = [cmd for cmd, _ in seen if "gguf" in cmd]
    eager = [cmd for cmd, _ in seen if "float32" in cmd]
    assert all("--no-compile" not in c for c in compiled) and all(
        "--no-compile" in c for c in eager
    )
