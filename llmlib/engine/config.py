"""``EngineConfig``: everything :class:`llmlib.LLM` runs with, asked for once and resolved once.

Every engine default is decided here, from the arguments, the flags record
(:mod:`llmlib.kernels.flags`: the CPU, the ``LLMLIB_*`` switches) and the machine; nothing
downstream picks its own. Two steps, as some answers need the loaded model:

* :meth:`EngineConfig.with_format`, before loading: device, activation dtype and weight format
  (:func:`llmlib.device.choose_format`), the fastest for one request with ``max_num_seqs=1``
  (``llmlib generate``, ``chat``), else for batches;
* :meth:`EngineConfig.resolved`, after: context length, pool, token budget and the *run mode*
  (:data:`RUN_MODES`, made a step object by :func:`llmlib.engine.run_mode.pick_steps`).

``llmlib generate``'s timing line and the server's ``/health`` print the resolved config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

#: How the engine's steps run: ``eager`` (the model over the paged step); ``fixed`` (fixed shapes
#: run as they are: a CPU asked for ``cuda_graphs``); ``cuda-graphs`` (all-decode steps replayed
#: from CUDA graphs); ``compiled`` (one compiled graph, on disk for a model from a file);
#: ``invariant``, ``invariant-compiled`` (batch-invariant, :mod:`llmlib.engine.invariant`).
RUN_MODES = ("eager", "fixed", "cuda-graphs", "compiled", "invariant", "invariant-compiled")


@dataclass(frozen=True)
class EngineConfig:
    """What :class:`llmlib.LLM` runs with: its keyword arguments; ``None`` is "the default",
    filled by :meth:`with_format` and :meth:`resolved` (the pool: :func:`default_num_blocks`)."""

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
    #: how the pool holds keys and values (:data:`llmlib.engine.paged_cache.KV_CACHE_DTYPES`):
    #: ``auto`` in the activations' dtype, ``int8`` as codes with a scale per row (CPU)
    kv_cache_dtype: str = "auto"
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
        needed = ("block_size", "max_num_seqs", "tensor_parallel_size")
        optional = ("num_blocks", "max_num_batched_tokens", "max_model_len", "kv_cache_bytes")
        for name in needed + optional:
            v = getattr(self, name)
            if (v is not None or name in needed) and (
                isinstance(v, bool) or not isinstance(v, int) or v <= 0
            ):
                raise ValueError(f"EngineConfig: {name} must be a positive integer, got {v!r}")
        from llmlib.engine.kv_rows import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig: kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype != "auto" and (
            self.batch_invariant or self.tensor_parallel_size != 1
        ):
            what = "batch_invariant=True" if self.batch_invariant else "tensor_parallel_size > 1"
            raise ValueError(
                f"LLM: kv_cache_dtype={self.kv_cache_dtype!r} with {what}: not implemented, for now"
            )
        if self.run_mode is not None and self.run_mode not in RUN_MODES:
            raise ValueError(f"EngineConfig: run_mode must be one of {RUN_MODES}")
        asked = [k for k in ("compile", "quantization", "batch_invariant") if getattr(self, k)]
        if self.tensor_parallel_size != 1 and asked:
            raise ValueError(
                f"LLM: {asked[0]}={getattr(self, asked[0])!r} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: not implemented for sharded ranks, for now"
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
        """Device, dtype and quantization to load ``model`` (a path) with: as asked, else the
        fastest accurate format (:func:`llmlib.device.choose_format`); a module keeps its own."""
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
        """Every default filled, for the loaded ``model`` (under tensor parallelism a rank's
        slice: its KV heads size the pool). ``source`` is what ``LLM`` was given: a checkpoint
        compiles by default on a CPU, a model not (:func:`llmlib.device.compiles_by_default`)."""
        from llmlib.device import compiles_by_default
        from llmlib.engine.kv_rows import kv_bytes_per_value
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
        if self.kv_cache_dtype != "auto" and device.type != "cpu":
            # the GPU kernels read float pools: an int8 one would be copied out every step
            raise ValueError(
                f"LLM: kv_cache_dtype={self.kv_cache_dtype!r} is read by the CPU kernel; "
                f"on {device.type} use 'auto'"
            )
        max_len = min(cfg.max_seq_len, self.max_model_len or cfg.max_seq_len)
        num_blocks = self.num_blocks or default_num_blocks(
            cfg, device, dtype, self.block_size, max_len, self.max_num_seqs, self.kv_cache_bytes,
            self.kv_cache_dtype,
        )  # fmt: skip
        budget = self.max_num_batched_tokens or (2048 if device.type == "cuda" else 512)
        per_block = kv_formula(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.block_size,
            kv_bytes_per_value(self.kv_cache_dtype, dtype, cfg.head_dim),
        )  # fmt: skip
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
        if self.kv_cache_dtype != "auto":
            pool += f" in {self.kv_cache_dtype}"
        return (
            f"{self.device}, {fmt}, steps {self.run_mode}{tp}; {self.num_blocks} KV blocks of "
            f"{self.block_size}{pool}, up to {self.max_num_seqs} sequences and "
            f"{self.max_num_batched_tokens} tokens a step, context {self.max_model_len}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (for ``/health`` and records)."""
        plain = (bool, int, float, str, type(None))
        return {k: v if isinstance(v, plain) else str(v) for k, v in vars(self).items()}


def default_num_blocks(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int | None,
    kv_cache_dtype: str = "auto",
) -> int:
    """The KV pool's size without ``num_blocks``: ``kv_cache_bytes`` worth (default: 80% of a
    GPU's free memory; on a CPU 1 GiB, or half of what is free if less, so a big model on a small
    machine gets the pool that fits beside it), at most ``max_num_seqs`` full sequences' worth."""
    from llmlib.device import free_memory
    from llmlib.engine.kv_rows import kv_bytes_per_value
    from llmlib.shapes import kv_cache_bytes as kv_formula

    per_value = kv_bytes_per_value(kv_cache_dtype, dtype, config.head_dim)
    per_block = kv_formula(
        config.n_layers, config.n_kv_heads, config.head_dim, block_size, per_value
    )
    if kv_cache_bytes is None:
        free = free_memory(device)
        if device.type == "cuda":
            kv_cache_bytes = int(free * 0.8)
        else:
            kv_cache_bytes = 1 << 30 if free is None else min(1 << 30, free // 2)
    needed = max_num_seqs * (-(-max_len // block_size) + 1)
    return max(1, min(needed, int(kv_cache_bytes // per_block)))
