"""The one file hasher: SHA-256 of files read in chunks, and digests remembered beside a cache.

Two things need a model file's digest: the fetch, which checks the book's model against its
published SHA-256 (:mod:`llmlib.checkpoints.fetch`), and the compiled steps kept on disk, which
are found again by the file they were compiled for (:mod:`llmlib.runtime.aot`). A multi-gigabyte
file takes seconds to read, so the second remembers each digest by path, size and modification
time (:func:`remembered_sha256`); the first always reads the bytes it checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def sha256(paths: Path | Sequence[Path], chunk: int = 1 << 22) -> str:
    """The SHA-256 of a file, or of several files' bytes one after the other."""
    h = hashlib.sha256()
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def remembered_sha256(files: Sequence[Path], memo: Path) -> str:
    """:func:`sha256` of ``files``, remembered in the JSON file ``memo`` by each file's path, size
    and modification time, so an unchanged file is read once (a changed one is read again)."""
    stamp = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    known: dict[str, Any] = {}
    if memo.exists():
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
    key = json.dumps(stamp)
    if key in known:
        return known[key]
    known[key] = digest = sha256(files)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(memo)  # atomic: a reader never sees half a file
    return digest
