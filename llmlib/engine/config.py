"""``EngineConfig``: everything :class:`llmlib.LLM` runs with, asked for once and resolved once.

A user asks for a few things (a format, a pool size, whether to compile) and leaves the rest to
the machine. Every one of those defaults is decided here, in one place, from three sources: the
arguments, the flags record (:mod:`llmlib.kernels.flags`: the CPU and the ``LLMLIB_*`` switches)
and the machine (its device, its free memory). ``LLM``, the ``llmlib`` commands and the server
all build an :class:`EngineConfig` and hand it to ``LLM``; nothing downstream picks a default of
its own. Resolution takes two steps, because some answers need the loaded model:

* :meth:`EngineConfig.with_format`, before loading: the device, the activations' dtype and the
  weight format (:func:`llmlib.device.choose_format`). An engine of one sequence
  (``max_num_seqs=1``, what ``llmlib generate`` and ``chat`` run) gets the format that decodes
  one request fastest; a batching engine the one that serves batches fastest. The two differ on
  some CPUs (on one with native bfloat16, the file's own blocks for one request, bfloat16
  matrices for batches), so ``LLM(path)`` and ``load_model(path)`` may load the same file in
  different formats: each says which it chose (``weight_format``).
* :meth:`EngineConfig.resolved`, after: the context length, the pool's size, the step's token
  budget and the *run mode*, how a step runs (:data:`RUN_MODES`; the step object itself is made
  by :func:`llmlib.engine.fixed_step.pick_steps`).

The resolved config is frozen and printable: the timing line of ``llmlib generate`` and the
server's ``/health`` show :meth:`describe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

#: How the engine's steps run, one name each:
#: ``eager`` every step as the model's plain forward pass over the paged step;
#: ``fixed`` all-decode steps on fixed shapes, run as they are (a CPU asked for ``cuda_graphs``:
#: what the tests exercise of the GPU path);
#: ``cuda-graphs`` those steps replayed from CUDA graphs;
#: ``compiled`` those steps through one compiled graph (kept on disk for a model from a file);
#: ``invariant`` every step batch-invariant, eager (:mod:`llmlib.engine.invariant`);
#: ``invariant-compiled`` every token a row of a fixed-size group through the compiled graph.
RUN_MODES = ("eager", "fixed", "cuda-graphs", "compiled", "invariant", "invariant-compiled")


@dataclass(frozen=True)
class EngineConfig:
    """What :class:`llmlib.LLM` runs with (see the module docstring). ``None`` means "the
    default": :meth:`with_format` and :meth:`resolved` fill every such field.

    ``device``, ``dtype``, ``quantization`` (and int4's ``group_size``): where and in which
    format (:func:`llmlib.load_model`).
    ``num_blocks`` x ``block_size``: the KV pool (default: ``kv_cache_bytes`` worth, else from the
    memory left after loading, :func:`default_num_blocks`). ``max_num_seqs``: sequences per step;
    ``max_num_batched_tokens``: tokens per step; ``max_model_len``: prompt plus output.
    ``compile``: the CPU's decode steps through a compiled graph; ``cuda_graphs``: replayed on a
    GPU; ``batch_invariant``: logits bitwise the same in any batch. ``tensor_parallel_size``,
    ``tp_options``: sharding (:mod:`llmlib.parallel`); ``speculative_config``: a
    :class:`~llmlib.speculative.SpeculativeConfig`.
    """

    device: Any = None
    dtype: Any = None
    quantization: str | None = None
    group_size: int | None = None
    num_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    compile: bool | None = None
    cuda_graphs: bool | None = None
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    tp_options: Any = None
    speculative_config: Any = None
    #: how a step runs, one of :data:`RUN_MODES` (set by :meth:`resolved`)
    run_mode: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig: {name} must be a positive integer, got {v!r}")
        for name in ("num_blocks", "max_num_batched_tokens", "max_model_len", "kv_cache_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(
                    f"EngineConfig: {name} must be a positive integer or None, got {v!r}"
                )
        if self.run_mode is not None and self.run_mode not in RUN_MODES:
            raise ValueError(f"EngineConfig: run_mode must be one of {RUN_MODES}")
        if self.tensor_parallel_size != 1 and (
            self.quantization is not None or self.batch_invariant or self.compile
        ):
            what = (
                "compile=True"
                if self.compile
                else f"quantization={self.quantization!r}"
                if self.quantization
                else "batch_invariant=True"
            )
            raise ValueError(
                f"LLM: {what} with tensor_parallel_size={self.tensor_parallel_size}: "
                "not implemented for sharded ranks, for now"
            )

    @classmethod
    def of(cls, config: EngineConfig | None, **kwargs: Any) -> EngineConfig:
        """``config``, or one made of the keyword arguments (both: the arguments override it)."""
        if config is None:
            return cls(**kwargs)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        return dataclasses.replace(config, **kwargs) if kwargs else config

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def one_sequence(self) -> bool:
        """An engine of one request at a time (``llmlib generate``, ``chat``)."""
        return self.max_num_seqs == 1

    def with_format(self, model: Any) -> EngineConfig:
        """The device, dtype and quantization to load ``model`` (a path) with: as asked, or when
        neither a dtype nor a quantization is given, the machine's fastest accurate format for
        this engine's batches (:func:`llmlib.device.choose_format`). A loaded model (an
        ``nn.Module``) keeps its own unless asked."""
        from pathlib import Path

        from llmlib.device import choose_format

        if isinstance(model, torch.nn.Module):
            return self
        gguf = Path(model).suffix == ".gguf"
        place, q = choose_format(
            self.device, self.dtype, self.quantization, gguf, batched=not self.one_sequence
        )
        return self.replace(device=place.device, dtype=place.dtype, quantization=q)

    def resolved(self, model: torch.nn.Module, source: Any) -> EngineConfig:
        """Every default filled, for the loaded ``model`` (a rank's slice under tensor
        parallelism: its KV heads size the pool). ``source`` is what ``LLM`` was given, a
        checkpoint's path or the model itself: a checkpoint compiles by default on a CPU, a
        model handed in does not (:func:`llmlib.device.compiles_by_default`)."""
        from llmlib.device import compiles_by_default
        from llmlib.shapes import kv_cache_bytes as kv_formula

        p = next(model.parameters())
        device, dtype = p.device, getattr(model, "dtype", p.dtype)
        cfg = model.config
        tp = self.tensor_parallel_size != 1
        compile = self.compile
        if compile is None:
            compile = compiles_by_default(
                source, device, self.speculative_config, tp, self.batch_invariant
            )
        if compile and device.type != "cpu":
            raise ValueError(
                "compile=True compiles the CPU engine's decode steps: "
                "on CUDA the decode steps replay CUDA graphs"
            )
        max_len = min(cfg.max_seq_len, self.max_model_len or cfg.max_seq_len)
        num_blocks = self.num_blocks or default_num_blocks(
            cfg, device, dtype, self.block_size, max_len, self.max_num_seqs, self.kv_cache_bytes
        )
        budget = self.max_num_batched_tokens or (2048 if device.type == "cuda" else 512)
        per_block = kv_formula(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.block_size, dtype.itemsize
        )
        return self.replace(
            kv_cache_bytes=int(num_blocks * per_block),
            device=device,
            dtype=dtype,
            compile=bool(compile),
            cuda_graphs=self._graphs(device, tp),
            max_model_len=max_len,
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            run_mode=self._mode(device, bool(compile), tp),
        )

    def _graphs(self, device: torch.device, tp: bool) -> bool:
        if tp:  # each step is a round of collectives: no graph replay
            return False
        return device.type == "cuda" if self.cuda_graphs is None else bool(self.cuda_graphs)

    def _mode(self, device: torch.device, compile: bool, tp: bool) -> str:
        if self.batch_invariant:
            return "invariant-compiled" if compile else "invariant"
        if compile:
            return "compiled"
        if self._graphs(device, tp):
            return "cuda-graphs" if device.type == "cuda" else "fixed"
        return "eager"

    def describe(self) -> str:
        """One line: where, in which format, how a step runs, the pool and the batch."""
        dtype = str(self.dtype).removeprefix("torch.")
        fmt = f"{dtype} activations" + (
            f", {self.quantization} weights" if self.quantization else ""
        )
        tp = f", {self.tensor_parallel_size} ranks" if self.tensor_parallel_size != 1 else ""
        pool = f" ({self.kv_cache_bytes / 2**20:.0f} MiB)" if self.kv_cache_bytes else ""
        return (
            f"{self.device}, {fmt}, steps {self.run_mode}{tp}; {self.num_blocks} KV blocks of "
            f"{self.block_size}{pool}, up to {self.max_num_seqs} sequences and "
            f"{self.max_num_batched_tokens} tokens a step, context {self.max_model_len}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (for ``/health`` and records)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
        return out


def default_num_blocks(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int | None,
) -> int:
    """The KV pool's size when no ``num_blocks`` is given: ``kv_cache_bytes`` worth, never more
    than ``max_num_seqs`` full-length sequences (plus one block each) could use. By default it is
    sized from the memory left once the weights are loaded: 80% of what is free on a GPU; on a CPU
    1 GiB, or half of what the system has left if that is less (a big model on a small machine
    gets the pool that fits beside it, not an out-of-memory kill)."""
    from llmlib.device import free_memory
    from llmlib.shapes import kv_cache_bytes as kv_formula

    per_block = kv_formula(
        config.n_layers, config.n_kv_heads, config.head_dim, block_size, dtype.itemsize
    )
    if kv_cache_bytes is None:
        free = free_memory(device)
        if device.type == "cuda":
            kv_cache_bytes = int(free * 0.8)
        else:
            kv_cache_bytes = 1 << 30 if free is None else min(1 << 30, free // 2)
    needed = max_num_seqs * (-(-max_len // block_size) + 1)
    return max(1, min(needed, int(kv_cache_bytes // per_block)))
