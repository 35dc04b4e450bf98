"""``llmlib bench NAME``: each benchmark is a module ``llmlib.bench.NAME`` with ``main(argv)``.

Benchmarks time llmlib against a reference in the same run and print medians and ratios, since
these machines are shared and noisy.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys


def save_json(res: dict, out: str | None) -> None:
    """Write a benchmark's results to ``out`` (``--out``), folders made as needed; ``None``: no file."""
    if out:
        import json
        from pathlib import Path

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2) + "\n")


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: llmlib bench NAME [ARGS...]\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(
            f"llmlib bench: unknown benchmark {name!r}; known: {', '.join(names)}", file=sys.stderr
        )
        return 2
    return int(importlib.import_module(f"llmlib.bench.{name}").main(argv[1:]) or 0)
