"""The engine's fixed-shape step: the one module of them, for one request and for sixty-four.

A decode step is a few hundred small operators. Two things make it fast, and both need a *fixed
shape* (the same tensors at the same addresses, whatever the batch): on a GPU a CUDA graph
replays the step with one launch (:class:`llmlib.runtime.graphs.StepGraphs`); on a CPU inductor
compiles it into one graph (:mod:`llmlib.runtime.compile`), exported once per machine with
symbolic sizes and kept on disk (:mod:`llmlib.runtime.aot`), beside a one-row package that
``llmlib generate`` runs for every token.

:class:`FixedStep` is such a step over the paged pool, in buffers allocated once and refilled each
step. :class:`FixedSteps` keeps one per shape, rounded up, for all-decode steps and, where they
fit, steps with prompt chunks. :func:`llmlib.engine.run_mode.pick_steps` decides which runs.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmlib.engine.kv_rows import SCALE_BYTES
from llmlib.engine.paged_cache import (
    DecodeGroup,
    PagedKVCache,
    SeqChunk,
    StepLayout,
    paged_attend,
    write_kv,
)
from llmlib.kernels.paged_attention import decode_attention, serves_pool, serves_spec
from llmlib.model.attention import AttentionSpec
from llmlib.runtime import aot
from llmlib.runtime.compile import compile_step
from llmlib.runtime.graphs import StepGraphs


def engine_forward(
    model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, step: Any
) -> torch.Tensor:
    """A fixed-shape step's forward pass: logits ``[rows, vocab]``, or of the rows ``heads``
    names, in order (the LM head, as wide as the vocabulary, runs only where a token is sampled)."""
    h = model.hidden(ids, positions, step)  # [1, rows, d_model]
    heads = getattr(step, "heads", None)
    # the rows stay the middle axis, as in a prefill's last position: a graph traced at one row
    # then multiplies the LM head with the same kernel a one-request decode step always had
    return model.logits(h if heads is None else h.index_select(1, heads))[0]


class FixedStep:
    """A step of ``rows`` tokens with fixed shapes and addresses, which a CUDA graph can replay.

    Every token is a row: id, position, write slot, block table (``blocks`` wide) and key count,
    in buffers allocated once (a :class:`~llmlib.engine.paged_cache.StepLayout` with one decode
    group) that :meth:`fill` rewrites, so a captured graph reads each new step on replay. Padding
    rows write into ``scratch_block``, which the block manager never hands out.

    Values are written through NumPy views (a few microseconds a step; a tensor operation per
    field costs that much each), on a GPU into pinned mirrors copied without blocking
    (:meth:`upload`) so the CPU prepares the next step while the GPU runs. ``masked=False``
    promises the kernel serves every attention, so :meth:`fill` leaves the (unread) masks."""

    def __init__(
        self,
        cache: PagedKVCache,
        rows: int,
        blocks: int,
        scratch_block: int,
        heads: int = 0,
        masked: bool = True,
    ) -> None:
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"FixedStep: scratch block {scratch_block} is not in the pool")
        dev, bs = cache.device, cache.block_size
        self.cache = cache
        self.num_rows, self.num_blocks, self.scratch_block = rows, blocks, scratch_block
        # ids, positions, write slots, keys per row, heads, table: filled with the padding
        R, pad_slot = rows, scratch_block * bs
        host = {
            "ids": torch.zeros((1, R), dtype=torch.long),
            "positions": torch.zeros((1, R), dtype=torch.long),
            "slots": torch.full((R,), pad_slot, dtype=torch.long),
            "lens": torch.ones(R, dtype=torch.long),  # keys per row, for the kernel
            "heads": torch.arange(heads or R) % R,  # an export's example may ask for more
            "table": torch.full((R * blocks,), scratch_block, dtype=torch.long),
        }
        on_gpu = dev.type != "cpu"
        if on_gpu and torch.cuda.is_available():  # staged in pinned memory: async copies
            host = {k: v.pin_memory() for k, v in host.items()}
        self._host = host
        self._np = {k: v.numpy() for k, v in host.items()}
        buf = {k: v.to(dev) for k, v in host.items()} if on_gpu else host
        mask = torch.zeros((rows, 1, 1, blocks * bs), dtype=torch.bool, device=dev)
        mask[..., 0] = True
        group = DecodeGroup(
            torch.zeros(rows, dtype=torch.long, device=dev),
            torch.arange(rows, device=dev),
            buf["table"],
            blocks,
            mask,
            buf["lens"],
        )
        self.ids = buf["ids"]
        self.layout = StepLayout(buf["positions"], buf["slots"], None, [], [group])
        self._buf = buf
        self._key_pos = torch.arange(blocks * bs, device=dev)
        #: the rows whose logits the step returns, in order
        self.heads = buf["heads"]
        #: whether :meth:`fill` keeps the masks: where some attention is not the kernel's
        self.masked = masked or not cache.kernel

    @classmethod
    def over(
        cls,
        cache: PagedKVCache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        table: torch.Tensor,
        mask: torch.Tensor,
        lens: torch.Tensor,
        heads: torch.Tensor,
    ) -> FixedStep:
        """A step over given buffers (``table``: ``[rows, blocks]``): a compiled step's inputs."""
        step = cls.__new__(cls)
        rows, blocks = table.shape
        step.cache, step.ids, step.num_rows, step.num_blocks = cache, ids, rows, blocks
        zeros = torch.zeros_like(lens)
        rows_ix = torch.arange(rows, device=ids.device)
        group = DecodeGroup(zeros, rows_ix, table.reshape(-1), blocks, mask, lens)
        step.layout = StepLayout(positions, write_slots, None, [], [group])
        step.heads, step.masked = heads, not cache.kernel
        return step

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's buffers in the order :meth:`over` takes them (after the pool)."""
        g = self.layout.decodes[0]
        table = g.table.view(self.num_rows, self.num_blocks)
        inputs = self.ids, self.layout.positions, self.layout.write_slots, table, g.mask, g.lens
        return (*inputs, self.heads)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        positions: torch.Tensor | None = None,  # unused: the step's layout holds them
    ) -> torch.Tensor:
        """Write the new keys and values, then attend: the kernel takes row ``i``'s query as it
        lies (fewer operators per layer); elsewhere :func:`~llmlib.engine.paged_cache.paged_attend`,
        whose window mask, computed from the position buffer, a replayed graph applies anew."""
        cache = self.cache
        if not (cache.kernel and serves_spec(spec)):
            return paged_attend(cache, self.layout, layer, q, k, v, spec)
        write_kv(cache, self.layout, layer, k, v)
        g = self.layout.decodes[0]
        n = q.shape[2]
        o = decode_attention(
            q[0].transpose(0, 1), cache.k[layer], cache.v[layer], g.table.view(n, -1), g.lens,
            scale=spec.scale, softcap=spec.softcap, window=spec.window,
        )  # fmt: skip
        return o.transpose(0, 1).unsqueeze(0)  # [1, H, rows, hd]

    def fill(
        self,
        chunks: Sequence[SeqChunk],
        token_ids: Sequence[int],
        heads: Sequence[int] | None = None,
    ) -> None:
        """Write one step, every token of ``chunks`` a row in order (all keys are written before
        any row attends, so a chunk's rows see each other as a prompt's do), the rest padding.
        ``heads``: the rows to return logits for (None leaves the buffer: by default all)."""
        bs, nb, R, a = self.cache.block_size, self.num_blocks, self.num_rows, self._np
        table = a["table"].reshape(R, nb)
        pos, slots = a["positions"][0], a["slots"]
        r = 0
        for c in chunks:
            n, end = c.length, c.start + c.length
            need = -(-end // bs)
            if need > nb or len(c.block_table) < need or r + n > R:
                raise ValueError(f"FixedStep: chunk {c} does not fit a step of {R} x {nb} blocks")
            if n == 1:  # a decoding sequence: a few scalar writes
                table[r, :need] = c.block_table[:need]
                pos[r], slots[r] = c.start, c.block_table[need - 1] * bs + c.start % bs
            else:
                blocks = np.asarray(c.block_table[:need], dtype=np.int64)
                table[r : r + n, :need] = blocks
                p = np.arange(c.start, end)
                pos[r : r + n], slots[r : r + n] = p, blocks[p // bs] * bs + p % bs
            table[r : r + n, need:] = self.scratch_block
            r += n
        a["ids"][0, :r] = token_ids[:r]
        if heads is not None:
            if len(heads) > len(a["heads"]):
                raise ValueError(f"FixedStep: {len(heads)} heads for {len(a['heads'])} rows")
            a["heads"][:] = 0
            a["heads"][: len(heads)] = heads
        self._pad(r)

    def _pad(self, k: int) -> None:
        """Pad rows ``k`` on, set the key counts from the positions, upload."""
        a = self._np
        if k < self.num_rows:
            a["ids"][0, k:] = 0
            a["positions"][0, k:] = 0
            a["slots"][k:] = self.scratch_block * self.cache.block_size
            a["table"].reshape(self.num_rows, self.num_blocks)[k:] = self.scratch_block
        np.add(a["positions"][0], 1, out=a["lens"])
        self.upload()
        if self.masked:
            g = self.layout.decodes[0]
            g.mask.copy_((self._key_pos[None, :] <= self.positions[0][:, None])[:, None, None])

    def upload(self) -> None:
        """Copy the host values to the device without blocking (on a CPU, nothing). The engine
        reads each step's tokens before filling the next, so no copy in flight is overwritten."""
        if self._buf is not self._host:
            for k, v in self._host.items():
                self._buf[k].copy_(v, non_blocking=True)


#: the most query-key pairs (length x keys, summed over chunks) of a step run every token a row
#: through the kernel: beyond it the eager attention, reading each key once a chunk, is faster
TOKEN_KEYS = 512 * 1024


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, capped at ``limit`` (n itself must be <= limit)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


class FixedSteps:
    """All-decode steps on fixed shapes: CUDA graphs on a GPU, one compiled graph on a CPU, or
    the shapes run as they are (what the tests exercise). A step runs on a :class:`FixedStep` of
    ``rows x blocks``, each rounded up to a power of two; with ``graphs`` each shape is captured
    when first needed (or by :meth:`capture`), all in one memory pool. ``path`` says what runs."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        cache: PagedKVCache,
        scratch_block: int,
        max_rows: int,
        max_blocks: int,
        *,
        graphs: bool = False,
        min_size: int = 1,
        masked: bool = True,
        path: str = "fixed shapes",
        warmup: int = 2,
    ) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(
                f"FixedSteps: max_rows ({max_rows}) and max_blocks ({max_blocks}) must be >= 1"
            )
        self.forward, self.cache, self.scratch_block = forward, cache, scratch_block
        self.max_rows, self.max_blocks = max_rows, max_blocks
        # torch.compile in memory traces sizes as symbols except a size of 1, for which it
        # would compile a second graph: such a step pads one row (or block) more
        self.min_size, self.path = min_size, path
        self.masked = masked
        self.token_steps = 0  # steps with prompt chunks run here (run_tokens)
        self.steps = StepGraphs(
            # (rows, blocks), or (rows, blocks, heads) for a step of any tokens (run_tokens)
            lambda key: FixedStep(cache, key[0], key[1], scratch_block, *key[2:], masked=masked),
            lambda s: forward(s.ids, s.positions, s),
            cache.device,
            graphs,
            warmup,
        )

    @property
    def enabled(self) -> bool:
        """Whether the steps are captured and replayed as CUDA graphs."""
        return self.steps.enabled

    @property
    def replays(self) -> int:
        """Steps served from a captured graph."""
        return self.steps.replays

    @property
    def static_steps(self) -> int:
        """Steps served by a fixed-shape step (graph or not)."""
        return self.steps.runs

    def fits(self, chunks: Sequence[Any]) -> bool:
        """Whether a step of these chunks can run here: all single tokens, within the limits."""
        if not chunks or len(chunks) > self.max_rows or any(c.length != 1 for c in chunks):
            return False
        bs = self.cache.block_size
        return max(c.start // bs + 1 for c in chunks) <= self.max_blocks

    def key(self, chunks: Sequence[Any]) -> tuple[int, int]:
        bs = self.cache.block_size
        return (
            bucket(max(len(chunks), self.min_size), self.max_rows),
            bucket(max(self.min_size, *(c.start // bs + 1 for c in chunks)), self.max_blocks),
        )

    def capture(self, max_rows: int | None = None, max_blocks: int | None = None) -> int:
        """Build (on a GPU, capture) every (rows, blocks) step up to these sizes ahead of time,
        largest first, so timed runs never pay for a capture. Returns how many exist."""
        R = min(max_rows or self.max_rows, self.max_rows)
        NB = min(max_blocks or self.max_blocks, self.max_blocks)
        rows = sorted({bucket(n, self.max_rows) for n in range(1, R + 1)}, reverse=True)
        blocks = sorted({bucket(n, self.max_blocks) for n in range(1, NB + 1)}, reverse=True)
        return self.steps.capture([(r, b) for r in rows for b in blocks])

    @torch.inference_mode()
    def run_padding(self, rows: int) -> None:
        """Run the ``rows``-row step once, all padding (an in-memory graph compiles here)."""
        size = min(self.min_size, self.max_blocks)
        step = self.steps.entry((bucket(max(rows, self.min_size), self.max_rows), size))[0]
        self.forward(step.ids, step.positions, step)

    def serves_tokens(self, chunks: Sequence[SeqChunk], max_rows: int) -> bool:
        """Whether a step with prompt chunks may run here, every token a row (:meth:`run_tokens`):
        no graphs (one per token count would be many), every attention the kernel's, at most
        ``max_rows`` tokens, and few enough keys (:data:`TOKEN_KEYS`) to be no slower."""
        if self.enabled or self.masked:
            return False
        bs = self.cache.block_size
        tokens = sum(c.length for c in chunks)
        keys = sum(c.length * (c.start + c.length) for c in chunks)
        blocks = max(-(-(c.start + c.length) // bs) for c in chunks)
        return tokens <= max_rows and blocks <= self.max_blocks and keys <= TOKEN_KEYS

    def run_tokens(
        self, chunks: Sequence[SeqChunk], token_ids: Sequence[int], select: Sequence[int]
    ) -> torch.Tensor:
        """Logits ``[len(select), vocab]``, every token a row (``serves_tokens`` must hold); rows
        round up to a power of two to 32, then a multiple of 32: little padding, few shapes."""
        bs, tokens = self.cache.block_size, len(token_ids)
        rows = bucket(tokens, 32) if tokens <= 32 else -(-tokens // 32) * 32
        blocks = bucket(max(-(-(c.start + c.length) // bs) for c in chunks), self.max_blocks)
        key = (rows, max(blocks, self.min_size), bucket(len(select), rows))
        out = self.steps.run(key, lambda step: step.fill(chunks, token_ids, select))
        self.token_steps += 1
        return out[: len(select)]

    def run(self, chunks: Sequence[Any], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` for one decode step (``fits(chunks)`` must hold)."""
        fixed = [
            c if isinstance(c, SeqChunk) else SeqChunk(c.seq.block_table, c.start, 1)
            for c in chunks
        ]
        out = self.steps.run(self.key(chunks), lambda step: step.fill(fixed, token_ids))
        return out if out.shape[0] == len(chunks) else out[: len(chunks)]


# ---- compiled ahead of time, kept on disk ------------------------------------------------------


def pool_over(k: list[torch.Tensor], v: list[torch.Tensor]) -> PagedKVCache:
    """A pool made of the given per-layer tensors (a compiled step's inputs), nothing allocated."""
    pool = PagedKVCache.__new__(PagedKVCache)
    pool.k, pool.v = k, v
    pool.num_blocks, pool.block_size, pool.n_kv_heads, pool.head_dim = k[0].shape
    pool.n_layers, pool.device, pool.dtype = len(k), k[0].device, k[0].dtype
    pool.kv_cache_dtype = "auto"
    if k[0].dtype == torch.int8:  # codes and a scale per row (paged_cache.quantize_rows)
        pool.head_dim -= SCALE_BYTES
        pool.kv_cache_dtype = "int8"
    pool.kernel = serves_pool(k[0])
    return pool


class ExportedStep(nn.Module):
    """The fixed-shape step as a module ``torch.export`` can trace: ``(ids, positions,
    write_slots, table, mask, lens, heads, *pool_k, *pool_v)`` -> logits, pool written in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, positions, write_slots, table, mask, lens, heads, *pool: torch.Tensor):
        n = len(pool) // 2
        cache = pool_over(list(pool[:n]), list(pool[n:]))
        step = FixedStep.over(cache, ids, positions, write_slots, table, mask, lens, heads)
        return engine_forward(self.model, ids, positions, step)


def load_package(
    model: nn.Module,
    cache: PagedKVCache,
    log: Callable[[str], None] | None = None,
    one_row: bool = False,
):
    """``(forward, cached)`` for the steps over ``cache`` from its package on disk (compiled
    first if missing); ``(None, False)`` where the model has no key or this cannot compile ahead
    of time (the caller then compiles in memory). Rows and heads are symbols: one package serves
    every batch. ``one_row`` traces the one-row step (``llmlib generate``'s), as a graph for any
    rows keeps a GEMM's code and one row wants a GEMV's (the one-row float32 kernel)."""
    wrapper = ExportedStep(model)

    def compile(path: Path) -> None:
        # example sizes unlike any other size of the graph (heads, block size): a symbolic size
        # equal to another in the example would be taken for the same symbol
        rows_ex, heads_ex = (1, 1) if one_row else (7, 13)
        step = FixedStep(cache, rows_ex, 5, cache.num_blocks - 1, heads=heads_ex)
        blocks = torch.export.Dim("blocks", min=2, max=1 << 16)
        pool = torch.export.Dim("pool", min=2)
        rows = None if one_row else torch.export.Dim("rows", min=1, max=4096)
        heads = None if one_row else torch.export.Dim("heads", min=1, max=4096)

        def dim(*axes: tuple[int, Any]) -> dict | None:  # the symbolic axes of one input
            kept = {axis: d for axis, d in axes if d is not None}
            return kept or None

        shapes = {
            "ids": dim((1, rows)),
            "positions": dim((1, rows)),
            "write_slots": dim((0, rows)),
            "table": dim((0, rows), (1, blocks)),
            "mask": dim((0, rows), (3, blocks * cache.block_size)),
            "lens": dim((0, rows)),
            "heads": dim((0, heads)),
            "pool": tuple({0: pool} for _ in range(2 * cache.n_layers)),
        }
        args = (*step.inputs, *cache.k, *cache.v)
        what = "the engine's one-row step" if one_row else "the engine's step"
        aot.export_and_package(wrapper, model, args, shapes, path, log, what)

    kind = f"engine-{'one' if one_row else 'heads'}-bs{cache.block_size}"
    if cache.kv_cache_dtype != "auto":  # the pools are inputs of another dtype and width
        kind += f"-kv-{cache.kv_cache_dtype}"
    loaded, cached = aot.load_step(model, kind, wrapper, compile, log)
    if loaded is None:
        return None, False

    def forward(ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        return loaded(*step.inputs, *step.cache.k, *step.cache.v)

    return forward, cached


#: model -> (its graph view, its step compiled in memory); every engine on the model shares one
_IN_MEMORY: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, Callable]] = (
    weakref.WeakKeyDictionary()
)


def compiled_forward(
    model: nn.Module,
    cache: PagedKVCache,
    log: Callable[[str], None] | None = None,
    rows: str = "any",
) -> tuple[Callable, str, float | None, bool]:
    """The compiled step, ``(forward, path, compile seconds, in memory)``, over a view of
    ``model`` holding what a graph should multiply (:func:`llmlib.runtime.compile.graph_view`).
    For a model from a file, its packages on disk (:func:`load_package`): ``rows="any"`` the
    one-row and any-row packages, ``"one"`` the first, ``"many"`` the second. Else one in-memory
    ``torch.compile`` graph, every size symbolic, shared by the model's engines and compiled at
    its first call (:meth:`llmlib.engine.run_mode.Steps.compile_now`)."""
    from llmlib.runtime.compile import graph_view

    t0 = time.perf_counter()
    if model in _IN_MEMORY:
        view, compiled = _IN_MEMORY[model]
        return functools.partial(compiled, view), "compiled (in memory)", None, True
    view = graph_view(model)
    many = one = None
    cached = True
    if rows in ("any", "many"):
        many, was = load_package(view, cache, log)
        cached = cached and was
    if rows in ("any", "one") and (many is not None or rows == "one"):
        one, was = load_package(view, cache, log, one_row=True)
        cached = cached and was
    if many is not None or one is not None:
        seconds = None if cached else time.perf_counter() - t0
        path = "compiled (from the cache)" if cached else "compiled (now, cached)"
        return _by_rows(one, many), path, seconds, False
    _IN_MEMORY[model] = view, compile_step(engine_forward, view, dynamic=True)
    return functools.partial(_IN_MEMORY[model][1], view), "compiled (in memory)", None, True


def _by_rows(one: Callable | None, many: Callable | None) -> Callable:
    """One forward for every step: a step of one row through ``one`` (where there is one)."""
    if one is None or many is None:
        return one or many  # type: ignore[return-value]

    def forward(ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        return (one if step.num_rows == 1 else many)(ids, positions, step)

    return forward
