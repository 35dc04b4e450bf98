"""Part of a checkpoint: every tensor named and shaped at once, its bytes read only when asked for.

A tensor-parallel rank holds a slice of most matrices (:mod:`llmlib.parallel.shard`). Reading
the whole checkpoint and cutting it afterwards would cost every rank the whole model's memory
while it loads; a :class:`LazyTensor` knows its shape and dtype, slicing it (``t[3]``,
``t[:, 64:128]``, :meth:`~LazyTensor.narrow`, :meth:`~LazyTensor.split`) only composes an index,
and :meth:`~LazyTensor.load` reads exactly the part indexed:

* safetensors: ``safe_open(file).get_slice(name)[index]`` copies just those elements out of the
  memory-mapped file;
* GGUF: a row of a block-quantized matrix is one contiguous run of bytes, and a range of columns
  that starts and ends on block boundaries is a sub-run of every row, so a slice is dequantized
  on its own (:func:`gguf_slice`). Query and key rows, which llama.cpp permutes head by head, are
  read in whole heads and un-permuted per head.

:func:`read_checkpoint_lazy` is :func:`llmlib.checkpoints.build.read_checkpoint` with lazy
tensors: the same names (through the same readers, :func:`llmlib.checkpoints.hf.read_hf_folder`
and the GGUF name table), and loading every tensor whole gives the same state dict (the tests
compare the two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmlib.config import ModelConfig

#: One entry per dimension of the stored tensor: an int (that dimension indexed away) or a
#: ``slice(start, stop)`` with both bounds set and step 1.
Index = tuple[Any, ...]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazyTensor:
    """A tensor in a checkpoint file, or a slice of one, not yet read.

    ``read(index)`` returns the stored tensor's elements at ``index`` (see :data:`Index`).
    Indexing with ints and step-1 slices, :meth:`narrow` and :meth:`split` give new lazy
    tensors; :meth:`load` reads. Passed to a torch function (``torch.equal``), it is read whole
    first, so code written for tensors still runs on it.
    """

    def __init__(
        self,
        read: Callable[[Index], torch.Tensor],
        shape: Seq[int],
        dtype: torch.dtype,
        index: Index | None = None,
    ) -> None:
        self._read, self.dtype = read, dtype
        self._index: Index = index if index is not None else tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index if isinstance(s, slice))

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __getitem__(self, key: Any) -> LazyTensor:
        key = key if isinstance(key, tuple) else (key,)
        view_dims = [i for i, s in enumerate(self._index) if isinstance(s, slice)]
        if len(key) > len(view_dims):
            raise IndexError(f"too many indices for a lazy tensor of shape {tuple(self.shape)}")
        index = list(self._index)
        for k, d in zip(key, view_dims):
            s = self._index[d]
            n = s.stop - s.start
            if isinstance(k, int):
                if not -n <= k < n:
                    raise IndexError(f"index {k} is out of range for a dimension of size {n}")
                index[d] = s.start + (k % n)
            elif isinstance(k, slice) and k.step in (None, 1):
                a, b, _ = k.indices(n)
                index[d] = slice(s.start + a, s.start + max(a, b))
            else:
                raise TypeError(f"a lazy tensor takes ints and step-1 slices, not {k!r}")
        return LazyTensor(self._read, (), self.dtype, tuple(index))

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return self[(slice(None),) * dim + (slice(start, start + length),)]

    def split(self, sizes: int | Seq[int], dim: int = 0) -> list[LazyTensor]:
        n = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - a) for a in range(0, n, sizes)]
        if sum(sizes) != n:
            raise ValueError(f"split sizes {list(sizes)} do not add up to {n}")
        out, a = [], 0
        for s in sizes:
            out.append(self.narrow(dim, a, s))
            a += s
        return out

    def load(self) -> torch.Tensor:
        """Read the indexed elements from the file (a tensor that owns its memory)."""
        t = self._read(self._index)
        if tuple(t.shape) != tuple(self.shape):
            raise ValueError(
                f"read a slice of shape {tuple(t.shape)}, expected {tuple(self.shape)}"
            )
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x: Any) -> Any:
            return x.load() if isinstance(x, LazyTensor) else x

        return func(*map(real, args), **{k: real(v) for k, v in (kwargs or {}).items()})


def materialize(t: LazyTensor | torch.Tensor) -> torch.Tensor:
    """A tensor, read if it is lazy."""
    return t.load() if isinstance(t, LazyTensor) else t


# ---- safetensors ---------------------------------------------------------------------------------


def _read_safetensor(handle: Any, name: str, shape: tuple[int, ...], index: Index) -> torch.Tensor:
    if all(isinstance(s, slice) and s.start == 0 and s.stop == n for s, n in zip(index, shape)):
        return handle.get_tensor(name)
    return handle.get_slice(name)[index].contiguous()


def lazy_safetensors(file: Path) -> dict[str, LazyTensor]:
    """Every tensor of one ``.safetensors`` file, lazily (the file stays memory-mapped)."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
        out = {}
        for name in handle.keys():
            sl = handle.get_slice(name)
            shape, dt = tuple(sl.get_shape()), sl.get_dtype()
            if dt not in _SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dt}, which llmlib does not read")
            read = functools.partial(_read_safetensor, handle, name, shape)
            out[name] = LazyTensor(read, shape, _SAFETENSORS_DTYPES[dt])
        return out
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(
            f"cannot read safetensors file {file} (truncated or corrupt?): {e}"
        ) from None


# ---- GGUF ------------------------------------------------------------------------------------------


def gguf_slice(reader: Any, info: Any, index: Index) -> torch.Tensor:
    """Dequantize ``index`` of one GGUF tensor, reading only its rows (and whole blocks of them).

    ``info`` is the tensor's :class:`~llmlib.gguf_file.TensorInfo`. Leading
    dimensions are indexed on the memory-mapped bytes (no copy); the last dimension's range is
    widened to whole quantization blocks, decoded, and trimmed.
    """
    from llmlib.checkpoints.quant import block_format, dequantize

    fmt = block_format(info.ggml_type, info.name)
    shape = tuple(info.shape)
    bs, bb = fmt.block_size, fmt.block_bytes
    try:
        raw = reader.raw(info.name)
        rows = raw.reshape(*shape[:-1], shape[-1] // bs * bb)[tuple(index[:-1])]
    except (TypeError, IndexError, OSError) as e:  # a memory map cut short by a truncated file
        raise ValueError(
            f"{info.name}: cannot read its data ({e}); the file is truncated or corrupt"
        ) from e
    last = index[-1]
    c0, c1 = (last, last + 1) if isinstance(last, int) else (last.start, last.stop)
    b0, b1 = c0 // bs, -(-c1 // bs)
    part = np.ascontiguousarray(rows[..., b0 * bb : b1 * bb])
    w = dequantize(part, info.ggml_type, (*part.shape[:-1], (b1 - b0) * bs), info.name)
    w = w[..., c0 - b0 * bs : c1 - b0 * bs]
    return w[..., 0] if isinstance(last, int) else w.contiguous()


def _read_permuted(reader: Any, info: Any, head_dim: int, index: Index) -> torch.Tensor:
    """Rows of a query or key matrix stored in llama.cpp's per-head order, in llmlib's order:
    whole heads are read and un-permuted, then trimmed to the rows asked for."""
    from llmlib.checkpoints.gguf import unpermute_qk

    rows = index[0]
    r0, r1 = (rows, rows + 1) if isinstance(rows, int) else (rows.start, rows.stop)
    h0, h1 = r0 // head_dim, -(-r1 // head_dim)
    w = gguf_slice(reader, info, (slice(h0 * head_dim, h1 * head_dim), *index[1:]))
    w = unpermute_qk(w, h1 - h0)[r0 - h0 * head_dim : r1 - h0 * head_dim]
    return w[0] if isinstance(rows, int) else w


def _shifted(reader: Any, info: Any, shift: float, index: Index) -> torch.Tensor:
    """A slice of a tensor stored plus ``shift`` (Gemma's norm gains, ``1 + w``), less it."""
    return gguf_slice(reader, info, index) - shift


def lazy_gguf(
    path: str | Path, sources: dict | None = None
) -> tuple[ModelConfig, dict[str, LazyTensor]]:
    """A GGUF file's config and its tensors in llmlib's names, lazily: what
    :func:`llmlib.checkpoints.gguf.read_gguf` returns, read on demand (the same
    :func:`~llmlib.checkpoints.gguf_arch.tensor_parts` of each tensor; ``sources`` as there)."""
    from llmlib.checkpoints.gguf import config_from_gguf, open_gguf
    from llmlib.checkpoints.gguf_arch import in_family, tensor_parts
    from llmlib.checkpoints.quant import block_format

    path = Path(path)
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, name=path.stem)
    for t in reader.tensors.values():
        block_format(t.ggml_type, t.name)  # unknown quantization type -> ValueError, before reading
    state: dict[str, LazyTensor] = {}
    extra: list[str] = []
    for t in reader.tensors.values():
        if t.name == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling
        parts = tensor_parts(cfg, reader.architecture, t.name, tuple(t.shape))
        if parts is None or not all(in_family(cfg, q.name) for q in parts):
            extra.append(t.name)
            continue
        for q in parts:
            if q.heads is not None:  # q and k rows llama.cpp permuted: read in whole heads
                read = functools.partial(_read_permuted, reader, t, cfg.head_dim)
            elif q.shift:
                read = functools.partial(_shifted, reader, t, q.shift)
            else:
                read = functools.partial(gguf_slice, reader, t)
            x = LazyTensor(read, t.shape, torch.float32)
            x = x if q.expert is None else x[q.expert]
            state[q.name] = x if q.rows is None else x[q.rows[0] : q.rows[1]]
            if sources is not None:
                sources[q.name] = q.source(t.name)
    if extra:
        raise ValueError(
            f"{path.name}: unexpected tensor(s) llmlib does not know: {', '.join(extra[:5])}"
        )
    return cfg, state


def read_checkpoint_lazy(
    path: str | Path,
) -> tuple[ModelConfig, dict[str, LazyTensor], Callable[[str], str]]:
    """``(config, lazy state dict in llmlib's names, llmlib name -> the checkpoint's name)``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.suffix == ".gguf":
        from llmlib.checkpoints.gguf_arch import gguf_name

        sources: dict[str, str] = {}
        cfg, state = lazy_gguf(path, sources)
        return cfg, state, lambda k: f"{k} (GGUF {sources.get(k) or gguf_name(k)})"
    if path.is_dir():
        from llmlib.checkpoints.hf import read_hf_folder

        cfg, state = read_hf_folder(path, read=lazy_safetensors)
        return cfg, state, str
    raise ValueError(
        f"{path} is neither a .gguf file nor a folder with config.json and safetensors"
    )


class GGUFBlocks:
    """One block-quantized matrix of a GGUF file, not yet read: ``kind`` (its type name) and,
    called, ``(kind, uint8 [rows, bytes per row])`` with the rows in llmlib's order (a query or
    key matrix's heads un-permuted: its blocks are whole rows). ``rows(i, j)`` reads rows
    ``i .. j-1`` alone, straight from the memory map (a matrix whose rows need no permuting).
    ``part`` is the range of the stored tensor's rows the matrix is (a fused tensor's split)."""

    def __init__(
        self, reader: Any, info: Any, heads: int | None, part: tuple[int, int] | None = None
    ) -> None:
        from llmlib.checkpoints.quant import block_format

        self.reader, self.info, self.heads = reader, info, heads
        self.kind = block_format(info.ggml_type, info.name).name
        self.r0, r1 = part or (0, info.shape[0])
        self.n_rows = r1 - self.r0

    def _raw(self) -> np.ndarray:
        try:
            raw = np.asarray(self.reader.raw(self.info.name), dtype=np.uint8)
            return raw.reshape(self.info.shape[0], -1)[self.r0 : self.r0 + self.n_rows]
        except (TypeError, ValueError, OSError) as e:  # a memory map cut short
            raise ValueError(
                f"{self.info.name}: cannot read its data ({e}); the file is truncated or corrupt"
            ) from e

    def rows(self, i: int, j: int) -> torch.Tensor:
        if self.heads is not None:
            raise ValueError(f"{self.info.name}: permuted rows are read whole")
        return torch.from_numpy(self._raw()[i:j].copy())

    def __call__(self) -> tuple[str, torch.Tensor]:
        from llmlib.checkpoints.gguf import unpermute_qk

        rows = torch.from_numpy(self._raw().copy())
        return self.kind, (rows if self.heads is None else unpermute_qk(rows, self.heads))


def lazy_gguf_blocks(path: str | Path, cfg: ModelConfig) -> dict[str, GGUFBlocks]:
    """``{llmlib name: its blocks}`` for every block-quantized matrix of a GGUF file
    (:class:`GGUFBlocks`); nothing is read until asked
    (:func:`llmlib.checkpoints.build.build_model` reads each matrix once)."""
    from llmlib.checkpoints.gguf import open_gguf
    from llmlib.checkpoints.gguf_arch import tensor_parts
    from llmlib.checkpoints.quant import block_format

    reader = open_gguf(Path(path))
    out: dict[str, GGUFBlocks] = {}
    for t in reader.tensors.values():
        if len(t.shape) != 2 or block_format(t.ggml_type, t.name).block_size == 1:
            continue
        for q in tensor_parts(cfg, reader.architecture, t.name, tuple(t.shape)) or ():
            out[q.name] = GGUFBlocks(reader, t, q.heads, q.rows)
    return out
