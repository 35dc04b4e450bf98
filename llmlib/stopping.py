"""Stop strings while streaming: where one starts, and how much text to hold back.

The Generator (one request) and the batching engine (many) both stream text piece by piece and
must never emit characters that later turn out to be the start of a stop string; one copy of
that logic serves both.
"""
from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], new_from: int) -> int | None:
    """Earliest index where a stop string starts, looking only where the newest piece could complete one."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still be the start of a stop string (not safe to emit yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
