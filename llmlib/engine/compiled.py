"""The engine's all-decode step compiled ahead of time, kept on disk (:mod:`llmlib.runtime.aot`).

``LLM(compile=True)`` runs every step in which all sequences decode one token through the
fixed-shape step of :class:`llmlib.engine.graphs.StaticDecodeStep`. For a model loaded from a
file, that step is exported once per machine into an AOTInductor package with the number of rows,
the blocks per row and the pool's size symbolic, so one package serves every batch size and
history length, and later engines load it in seconds instead of compiling again. Its inputs are
the step's buffers and the pool's tensors; the model's weights stay its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmlib.engine.graphs import StaticDecodeStep
from llmlib.engine.paged_cache import PagedKVCache
from llmlib.kernels.paged_attention import serves_pool
from llmlib.runtime import aot
from llmlib.runtime.compile import engine_forward


def pool_over(k: list[torch.Tensor], v: list[torch.Tensor]) -> PagedKVCache:
    """A pool made of the given per-layer tensors (a compiled step's inputs), nothing allocated."""
    pool = PagedKVCache.__new__(PagedKVCache)
    pool.k, pool.v = k, v
    pool.num_blocks, pool.block_size, pool.n_kv_heads, pool.head_dim = k[0].shape
    pool.n_layers, pool.device, pool.dtype = len(k), k[0].device, k[0].dtype
    pool.kernel = serves_pool(k[0])
    return pool


class EngineStep(nn.Module):
    """The all-decode step as a module ``torch.export`` can trace:
    ``(ids, positions, write_slots, table, mask, lens, heads, *pool_k, *pool_v)`` -> logits
    ``[heads, vocab]``, the pool written in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, positions, write_slots, table, mask, lens, heads, *pool: torch.Tensor):
        n = len(pool) // 2
        cache = pool_over(list(pool[:n]), list(pool[n:]))
        step = StaticDecodeStep.over(cache, ids, positions, write_slots, table, mask, lens, heads)
        return engine_forward(self.model, ids, positions, step)


def load_engine_step(
    model: nn.Module, cache: PagedKVCache, log: Callable[[str], None] | None = None
):
    """``forward(ids, positions, step)`` for the engine's fixed-shape decode steps over ``cache``,
    from its package on disk (compiled and stored first if there is none): ``(forward, cached)``,
    or ``(None, False)`` where the model has no key or the step cannot be compiled ahead of time
    here (the runner then compiles it in memory). The rows are a symbol: one package serves
    every batch, and both group sizes of the batch-invariant engine
    (:class:`llmlib.engine.invariant.InvariantRows`)."""
    wrapper = EngineStep(model)

    def compile(path: Path) -> None:
        # example sizes unlike any other size of the graph (heads, block size): a symbolic size
        # equal to another in the example would be taken for the same symbol
        step = StaticDecodeStep(cache, 7, 5, cache.num_blocks - 1, heads=13)
        rows = torch.export.Dim("rows", min=2, max=4096)
        heads = torch.export.Dim("heads", min=2, max=4096)
        blocks = torch.export.Dim("blocks", min=2, max=1 << 16)
        pool = torch.export.Dim("pool", min=2)
        shapes = {
            "ids": {1: rows},
            "positions": {1: rows},
            "write_slots": {0: rows},
            "table": {0: rows, 1: blocks},
            "mask": {0: rows, 3: blocks * cache.block_size},
            "lens": {0: rows},
            "heads": {0: heads},
            "pool": tuple({0: pool} for _ in range(2 * cache.n_layers)),
        }
        args = (*step.inputs, *cache.k, *cache.v)
        aot.export_and_package(wrapper, model, args, shapes, path, log, "the engine's decode step")

    loaded, cached = aot.load_step(
        model, f"engine-heads-bs{cache.block_size}", wrapper, compile, log
    )
    if loaded is None:
        return None, False

    def forward(ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        return loaded(*step.inputs, *step.cache.k, *step.cache.v)

    return forward, cached
