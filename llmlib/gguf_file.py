"""A small, fast reader for the GGUF container: header, metadata and tensor directory.

The `gguf` package's ``GGUFReader`` builds a numpy view for every field part, which takes
seconds on a tokenizer of 49,152 tokens and 48,900 merges. This reader walks the same format
once with ``struct`` and decodes numeric arrays with one ``numpy.frombuffer`` each, so opening
SmolLM2's file takes a fraction of a second. Tensor data stays memory-mapped; nothing is copied
until a tensor is asked for. (No pickle anywhere: GGUF is a flat binary format.)

Format (little-endian): ``b"GGUF"``, version u32, tensor count u64, metadata count u64; then the
metadata as (key string, value type u32, value); then per tensor (name, n_dims u32, dims u64 x
n_dims, ggml type u32, offset u64); then padding to ``general.alignment`` and the tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# metadata value types
(
    _UINT8,
    _INT8,
    _UINT16,
    _INT16,
    _UINT32,
    _INT32,
    _FLOAT32,
    _BOOL,
    _STRING,
    _ARRAY,
    _UINT64,
    _INT64,
    _FLOAT64,
) = range(13)
_SCALAR = {  # type -> (struct format, numpy dtype)
    _UINT8: ("<B", np.uint8),
    _INT8: ("<b", np.int8),
    _UINT16: ("<H", np.uint16),
    _INT16: ("<h", np.int16),
    _UINT32: ("<I", np.uint32),
    _INT32: ("<i", np.int32),
    _FLOAT32: ("<f", np.float32),
    _BOOL: ("<?", np.bool_),
    _UINT64: ("<Q", np.uint64),
    _INT64: ("<q", np.int64),
    _FLOAT64: ("<d", np.float64),
}

#: ggml tensor types llmlib knows: id -> (name, values per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file llmlib can read, or it is cut short."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch/numpy order (GGUF stores dims innermost first; reversed here)
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]


#: the last files' parsed headers, by path and stat (inode, size, times): loading a model reads
#: one header for its config, its tensors and its tokenizer, and the vocabulary is most of it;
#: notebooks and the vocabulary tests switch between a few files. The one cache of a header.
_HEADERS: dict[tuple, tuple] = {}
_KEEP = 4


class GGUFFile:
    """An opened GGUF file: ``metadata`` (dict), ``tensors`` (name -> :class:`TensorInfo`), raw bytes.

    A file opened again, unchanged, takes its header from the last parse (``metadata`` is
    then shared: read it, never change it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise GGUFFormatError(f"{self.path}: empty file, not GGUF") from e
        self._buf = memoryview(self._mm)
        self._pos = 0
        key = (str(self.path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in _HEADERS:
            self.version, self.metadata, self.tensors, self.data_offset = _HEADERS[key]
            return
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF header ({e})") from e
        _HEADERS[key] = (self.version, self.metadata, self.tensors, self.data_offset)
        while len(_HEADERS) > _KEEP:
            del _HEADERS[next(iter(_HEADERS))]

    # -- low-level readers ------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise GGUFFormatError(
                f"{self.path}: file ends at byte {len(self._buf)} inside the header (truncated?)"
            )
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise GGUFFormatError(
                f"{self.path}: a string runs past the end of the file (truncated?)"
            )
        s = bytes(self._buf[self._pos : end]).decode("utf-8")
        self._pos = end
        return s

    def _strings(self, count: int) -> list[str]:
        buf, pos, size, out = self._buf, self._pos, len(self._buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise GGUFFormatError(f"{self.path}: file ends inside the header (truncated?)")
            (n,) = length(buf, pos)
            end = pos + 8 + n
            if end > size:
                raise GGUFFormatError(
                    f"{self.path}: a string runs past the end of the file (truncated?)"
                )
            out.append(str(buf[pos + 8 : end], "utf-8"))
            pos = end
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype][0])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype in _SCALAR:
                dt = np.dtype(_SCALAR[etype][1]).newbyteorder("<")
                end = self._pos + count * dt.itemsize
                if end > len(self._buf):
                    raise GGUFFormatError(
                        f"{self.path}: an array runs past the end of the file (truncated?)"
                    )
                arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos).copy()
                self._pos = end
                return arr.tolist()
            if etype == _STRING:  # a vocabulary: tens of thousands, read in one tight loop
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")

    # -- the file -----------------------------------------------------------------------------
    def _parse(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(
                f"{self.path}: GGUF version {self.version} is not supported (2 or 3)"
            )
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        raw = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = [self._unpack("<Q") for _ in range(n_dims)]
            raw.append((name, tuple(reversed(dims)), self._unpack("<I"), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_offset = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, gtype, off in raw:
            n = int(np.prod(shape)) if shape else 1
            if gtype in GGML_TYPES:
                _, per_block, block_bytes = GGML_TYPES[gtype]
                if n % per_block:
                    raise GGUFFormatError(
                        f"{self.path}: tensor {name!r} has {n} values, not a multiple of its block size {per_block}"
                    )
                nbytes = n // per_block * block_bytes
            else:
                nbytes = -1  # unknown type: reported when the tensor is read
            self.tensors[name] = TensorInfo(name, shape, gtype, self.data_offset + off, nbytes)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a uint8 array (a view of the memory map; no copy)."""
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r} in the file")
        t = self.tensors[name]
        if t.nbytes < 0:
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} has ggml type {t.ggml_type}, which llmlib cannot read "
                f"(known: {', '.join(v[0] for v in GGML_TYPES.values())})"
            )
        if t.offset + t.nbytes > len(self._buf):
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} needs bytes up to {t.offset + t.nbytes} but the file "
                f"has {len(self._buf)} (truncated?)"
            )
        return np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Open a GGUF file and read its header (metadata and tensor directory)."""
    return GGUFFile(path)
