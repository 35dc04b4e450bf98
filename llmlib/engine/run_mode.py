"""How an engine's steps run: the one choice, from its run mode to the step object.

:func:`pick_steps` turns an engine's run mode (:data:`llmlib.engine.config.RUN_MODES`, resolved
in its :class:`~llmlib.engine.config.EngineConfig`) into the :class:`Steps` the runner calls.
Where a mode cannot run as asked, ``Steps.path`` says why and what runs instead.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from llmlib.engine.fixed_step import FixedSteps, compiled_forward, engine_forward
from llmlib.engine.paged_cache import PagedKVCache
from llmlib.kernels.paged_attention import serves_spec


@dataclass
class Steps:
    """How an engine's steps run, as :func:`pick_steps` chose them. ``model`` runs the steps no
    fixed shape serves (in the eager batch-invariant mode, a row-tiled view); ``decode``
    all-decode steps on fixed shapes; ``tokens`` steps with prompt chunks, every token a row
    (:meth:`~llmlib.engine.fixed_step.FixedSteps.serves_tokens`), so a step mixing prompts and
    decodes runs the compiled graph too; ``rows`` every step, in fixed groups (compiled
    batch-invariant). ``path`` says what runs, ``compile_s`` what compiling cost this process."""

    model: nn.Module
    decode: FixedSteps | None = None
    tokens: FixedSteps | None = None  # steps with prompt chunks, every token a row
    rows: Any = None  # llmlib.engine.invariant.InvariantRows
    invariant: bool = False
    path: str = "eager"
    compile_s: float | None = None
    in_memory: bool = False  # a graph compiled in memory, at its first call

    @property
    def scratch(self) -> bool:
        """Whether the pool needs a scratch block (padding rows write into it)."""
        return self.decode is not None or self.rows is not None

    def compile_now(self, rows: int) -> float | None:
        """Compile an in-memory graph now, before any request waits, on ``rows`` padding rows
        (inductor tunes for the rows it first sees); the seconds it took (None: nothing to do)."""
        if not self.in_memory or self.decode is None:
            return self.compile_s
        graph = getattr(self.decode.forward, "func", None)  # the partial's compiled function
        if not getattr(graph, "warm", False):
            msg = "llmlib: compiling the engine's step (minutes on a small CPU)..."
            print(msg, file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        self.decode.run_padding(rows)
        if graph is not None:
            graph.warm = True
        self.in_memory, self.compile_s = False, time.perf_counter() - t0
        return self.compile_s


def scratch_blocks(mode: str) -> int:
    """Blocks the pool holds beyond the block manager's: the scratch block of padding rows."""
    return 0 if mode in ("eager", "invariant") else 1


def pick_steps(
    mode: str,
    model: nn.Module,
    cache: PagedKVCache,
    *,
    scratch_block: int,
    max_rows: int,
    max_blocks: int,
    log: Callable[[str], None] | None = None,
) -> Steps:
    """The :class:`Steps` of run mode ``mode`` over ``cache``; ``scratch_block`` is past the
    block manager's; ``max_rows``, ``max_blocks`` (a step's sequences, a context) bound a shape."""
    if mode in ("eager", "invariant"):
        return _invariant_eager(model, None) if mode == "invariant" else Steps(model)
    if mode == "invariant-compiled":
        return _invariant_compiled(model, cache, scratch_block, max_blocks, log)
    layers = getattr(model, "layers", ())
    masked = not (cache.kernel and all(serves_spec(layer.attn.spec) for layer in layers))
    limits = dict(
        scratch_block=scratch_block, max_rows=max_rows, max_blocks=max_blocks, masked=masked
    )
    if mode == "compiled":
        # an engine of one sequence decodes one row a step: the one-row package alone (its
        # prompts run eagerly, as the Generator's do)
        rows = "one" if max_rows == 1 else "any"
        forward, path, seconds, in_memory = compiled_forward(model, cache, log, rows)
        decode = FixedSteps(forward, cache, **limits, min_size=2 if in_memory else 1, path=path)
        tokens = None if rows == "one" and not in_memory else decode
        return Steps(model, decode, tokens, path=path, compile_s=seconds, in_memory=in_memory)
    if mode in ("fixed", "cuda-graphs"):
        forward = functools.partial(engine_forward, model)
        graphs = mode == "cuda-graphs"
        if graphs and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the KV pool on a CUDA device")
        why = capture_refused(model) if graphs else None
        graphs = graphs and why is None
        path = "CUDA graphs" if graphs else "fixed shapes"
        if why is not None:
            path += f" (CUDA graphs refused: {why})"
        decode = FixedSteps(forward, cache, **limits, graphs=graphs, path=path)
        # a graph per token count would be many: prompt steps as rows only where not captured
        return Steps(model, decode, None if graphs else decode, path=path)
    raise ValueError(f"pick_steps: no run mode {mode!r}")


def capture_refused(model: nn.Module) -> str | None:
    """Why a CUDA graph cannot capture ``model``'s step (None: it can). A graph replays without
    the host, so a step that reads a value back to decide what runs next would replay the first
    decision forever; mixture-of-experts routing does (it learns the picked experts on the host)."""
    from llmlib.model.block import MoEFeedForward

    if any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return "mixture-of-experts routing reads the chosen experts on the host"
    return None


def _invariant_eager(model: nn.Module, why: str | None) -> Steps:
    """Products in fixed row tiles (a view sharing the weights), attention in an order fixed by
    each query's position (:class:`llmlib.engine.invariant.InvariantStep`)."""
    from llmlib.engine.invariant import ROW_CHOICES, ROW_TILE
    from llmlib.kernels.prepare import row_tiled

    path = (
        "eager" if why is None else f"eager ({why}, so the batch-invariant steps are not compiled)"
    )
    return Steps(row_tiled(model, ROW_TILE, ROW_CHOICES[1:]), invariant=True, path=path)


def _invariant_compiled(model, cache, scratch_block, max_blocks, log) -> Steps:
    """Fixed-size groups through the compiled step (:class:`llmlib.engine.invariant.InvariantRows`)
    where a size computes every row alike; else the eager ones, the reason in ``path``."""
    from llmlib.engine.invariant import InvariantRows, rows_compile

    why = rows_compile(model, cache)
    if why is not None:
        return _invariant_eager(model, why)
    forward, path, seconds, in_memory = compiled_forward(model, cache, log, "many")
    rows = InvariantRows(forward, cache, scratch_block, max_blocks)
    t0 = time.perf_counter()
    if in_memory:
        print("llmlib: compiling the engine's step (minutes on a small CPU)...", file=sys.stderr)
    why = rows.settle()  # runs the graph: one compiled in memory compiles here
    if in_memory:
        seconds = time.perf_counter() - t0
    if why is not None:
        return _invariant_eager(model, why)
    return Steps(model, rows=rows, invariant=True, path=path, compile_s=seconds)
