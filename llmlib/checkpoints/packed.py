"""A quantized model's packed weights kept on disk: packed at the first load, mapped at every
later one.

Packing a GGUF file's blocks into the integer kernels' layouts reads and rewrites every byte of
the file, tens of seconds for an 8B model on a small CPU, and it gives the same bytes every time
for the same file, format and machine. So after the first load :func:`save` writes the layouts
to one safetensors file in the cache (``packed/<key>.safetensors``), and later loads
(:func:`open_packed`) map that file instead of packing: each buffer is a view of the mapping, so
the weights are the page cache's pages, read from disk once and shared by every process that
maps them.

Only a model whose every matrix is held by llmlib's integer kernels is kept
(:class:`~llmlib.kernels.integer.VnniWeight`, alone or stacked): their buffers are all there is
to them. The key (:func:`key`) names the file's SHA-256, the format, llmlib's and torch's
versions and every CPU choice (:class:`~llmlib.kernels.flags.Flags`), so a changed choice packs
again. ``LLMLIB_PACKED_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmlib.kernels import integer
from llmlib.kernels.flags import flags
from llmlib.kernels.stacked import StackedWeight
from llmlib.kernels.weights import PackedWeight

VERSION = 1
#: the integer kernels' layouts a cache may hold, by class name
KINDS = {
    c.__name__: c
    for c in (
        integer.VnniInt8Weight,
        integer.VnniInt4Weight,
        integer.VnniInt8GroupWeight,
        integer.VnniInt6Weight,
    )
}
_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "F16": torch.float16, "F32": torch.float32,
           "BF16": torch.bfloat16}  # fmt: skip
_NAMES = {v: k for k, v in _DTYPES.items()}


def enabled() -> bool:
    return flags().packed_cache


def key(path: Path, fmt: Any) -> str:
    """The cache file's name for ``path`` loaded in ``fmt`` on this machine."""
    import llmlib
    from llmlib.runtime.aot import file_digest

    f = flags()
    parts = {
        "version": VERSION,
        "llmlib": llmlib.__version__,
        "torch": torch.__version__,
        "model": file_digest(path),
        "format": [str(fmt.device), str(fmt.dtype), fmt.quantization, fmt.group_size, fmt.plain],
        "flags": f.describe(),
        "cpu": sorted(f.cpu_flags),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(path: Path, fmt: Any) -> Path:
    return flags().cache / "packed" / f"{key(path, fmt)}.safetensors"


def _describe(w: PackedWeight) -> dict[str, Any] | None:
    """What rebuilds ``w`` from its buffers, or None where it is not a kind kept here."""
    if isinstance(w, StackedWeight):
        parts = [_describe(p) for p in w.parts]
        return None if None in parts else {"stacked": parts}
    if type(w).__name__ not in KINDS:
        return None
    return {
        "kind": type(w).__name__,
        "shape": list(w.shape),
        "group_size": getattr(w, "group_size", None),
        "buffers": [n for n, _ in w.named_buffers(recurse=False)],
    }


def _buffers(prefix: str, w: PackedWeight, out: dict[str, torch.Tensor]) -> None:
    if isinstance(w, StackedWeight):
        for i, p in enumerate(w.parts):
            _buffers(f"{prefix}.{i}", p, out)
        return
    for name, b in w.named_buffers(recurse=False):
        out[f"{prefix}.{name}"] = b


def save(matrices: dict[str, PackedWeight | Any], target: Path) -> bool:
    """Write ``{module name: weight}`` to ``target`` when every weight is a kind kept here;
    whether it did. Written beside and renamed, so a crash never leaves half a file."""
    layout, tensors = {}, {}
    for name, w in matrices.items():
        d = _describe(w) if isinstance(w, PackedWeight) else None
        if d is None:
            return False
        layout[name] = d
        _buffers(name, w, tensors)
    header: dict[str, Any] = {"__metadata__": {"layout": json.dumps(layout)}}
    offset, starts = 0, []
    for name, t in tensors.items():
        offset += -offset % 64  # every tensor 64-byte aligned, so each views as its dtype
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}  # fmt: skip
        starts.append(offset)
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 64)  # the data starts 64-byte aligned, as the kernels' loads like
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        at = 0
        for start, t in zip(starts, tensors.values(), strict=True):
            f.write(b"\0" * (start - at))
            data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
            f.write(memoryview(data))
            at = start + data.size
    tmp.replace(target)
    return True


class Packed:
    """A cache file opened: ``weight(name)`` is the module's weight rebuilt on views of the
    mapping (None for a name the file does not hold)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            # private and copy-on-write: pages come from the file; a write (none is made)
            # would copy the page instead of changing the file
            self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
        self.path = path
        self.layout = json.loads(header.pop("__metadata__")["layout"])
        self._header, self._start = header, 8 + n

    def _tensor(self, name: str) -> torch.Tensor:
        h = self._header[name]
        lo, hi = h["data_offsets"]
        dtype, shape = _DTYPES[h["dtype"]], h["shape"]
        if hi == lo:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=hi - lo, offset=self._start + lo)
        return raw.view(dtype).view(shape)

    def _build(self, prefix: str, d: dict[str, Any]) -> PackedWeight:
        if "stacked" in d:
            return StackedWeight(
                [self._build(f"{prefix}.{i}", p) for i, p in enumerate(d["stacked"])]
            )
        cls = KINDS[d["kind"]]
        w = cls.__new__(cls)
        integer.VnniWeight.__init__(w, tuple(d["shape"]))
        if d["group_size"] is not None:
            w.group_size = d["group_size"]
        for b in d["buffers"]:
            w.register_buffer(b, self._tensor(f"{prefix}.{b}"))
        if hasattr(w, "refresh"):
            w.refresh()
        return w

    def weight(self, name: str) -> PackedWeight | None:
        d = self.layout.get(name)
        return None if d is None else self._build(name, d)


def open_packed(path: Path, fmt: Any) -> Packed | None:
    """The cache file for ``path`` in ``fmt``, opened; None where there is none (or the cache is
    off, or the file cannot be read: it is then packed again and rewritten)."""
    if not enabled() or fmt.device.type != "cpu" or not integer.available():
        return None
    target = cache_path(path, fmt)
    if not target.exists():
        return None
    try:
        return Packed(target)
    except (OSError, ValueError, KeyError, struct.error) as e:
        print(f"llmlib: {target} cannot be read ({e}); packing the weights again", flush=True)
        target.unlink(missing_ok=True)
        return None


def keep(model: nn.Module, path: Path, fmt: Any) -> Path | None:
    """After a load that packed: write the cache file for ``path`` in ``fmt``, where the cache is
    on and every matrix is a kind kept here; its path, or None."""
    from llmlib.kernels.prepare import _tables

    if not enabled() or fmt.device.type != "cpu":
        return None
    matrices = {n: m.weight for n, m in _tables(model).items()}
    target = cache_path(path, fmt)
    try:
        return target if save(matrices, target) else None
    except OSError as e:  # a full or read-only disk: the model is loaded all the same
        print(f"llmlib: the packed weights could not be kept in {target.parent} ({e})", flush=True)
        return None
