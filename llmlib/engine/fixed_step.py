"""The engine's fixed-shape step, and the one choice of how every step runs.

This is the one module of fixed-shape steps: one request (``llmlib generate``) and a batch of
sixty-four run the same step here, as in vLLM and nano-vllm, whatever makes it fast.

A step in which every running sequence decodes one token is a few hundred small operators. Two
things make it fast, and both need it to have a *fixed shape*: the same tensors at the same
addresses, whatever the batch and the histories' lengths.

* On a GPU, a CUDA graph records the step once and replays it with one launch
  (:class:`llmlib.runtime.graphs.StepGraphs`), where the CPU would otherwise spend longer
  launching the kernels than the GPU spends running them.
* On a CPU, inductor compiles the step into one graph, fusing each layer's small operators and
  picking its own matrix kernels (:mod:`llmlib.runtime.compile`). For a model loaded from a file
  the graph is exported once per machine with every size symbolic and kept on disk
  (:mod:`llmlib.runtime.aot`): one package serves every batch size and history length, and later
  starts load it in a second.

:class:`FixedStep` is such a step over the paged pool: ``rows`` tokens, each a row with its own
position, write slot, block table and key count, in buffers allocated once; :meth:`FixedStep.fill`
copies a new step's values into them. :class:`FixedSteps` keeps one per shape (rows and blocks,
each rounded up to a power of two). The batch-invariant mode feeds every token of a step through
the same step, in groups of fixed size (:class:`llmlib.engine.invariant.InvariantRows`).

Which of these runs an engine's steps is decided in one place,
:func:`llmlib.engine.run_mode.pick_steps`.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    """The engine's forward pass over one step: logits ``[rows, vocab]``, or, for a step with a
    ``heads`` buffer, only the rows it names, in its order (the LM head, a product as wide as the
    vocabulary, runs only where a token is sampled). What a fixed-shape step runs, eagerly,
    compiled, or captured in a CUDA graph."""
    h = model.hidden(ids, positions, step)[0]
    heads = getattr(step, "heads", None)
    return model.logits(h if heads is None else h.index_select(0, heads))


class FixedStep:
    """A step of ``rows`` tokens with fixed shapes and addresses, which a CUDA graph can replay.

    Every token is a row: its id, its position, the pool slot its keys and values go to, its
    sequence's block table (``blocks`` wide) and how many keys it sees. All of it lives in
    buffers allocated once (a :class:`~llmlib.engine.paged_cache.StepLayout` with one decode
    group); :meth:`fill` or :meth:`load` writes a new step's values into them, so a graph
    captured over this step reads the new values on replay. Rows past the real ones are padding:
    they write into ``scratch_block``, a block the block manager never hands out, and read only
    its first slot.

    The values are written on the host, through NumPy views (a few microseconds for a whole
    step, where a tensor operation per field costs that much each). On a CPU those views are the
    step's own buffers; on a GPU they are pinned host mirrors, copied to the device buffers
    without blocking (:meth:`upload`), so the CPU prepares the next step while the GPU runs.

    Only the rows the ``heads`` buffer names get logits (by default every row, in order).
    ``masked=False`` promises that the kernel serves every layer's attention, so the masks are
    never read and :meth:`load` leaves them as they are.
    """

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
        #: whether :meth:`load` keeps the masks: where some attention is not the kernel's
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
        """A step over the given buffers (``table`` as ``[rows, blocks]``): what a step compiled
        ahead of time receives as its inputs."""
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
        """Write the new keys and values, then attend: row ``i`` is the query at column ``i`` of
        the one decode group, so where the kernel serves, the queries go to it as they lie (no
        index picks them out, none puts the output back: a few operators less per layer, on
        every step). Elsewhere, the paged step's masked attention (a sliding window is a mask
        computed from the position buffer, so a captured graph applies it on every replay)."""
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

    def fill(self, chunks: Sequence[SeqChunk], token_ids: Sequence[int]) -> None:
        """Write one step's single-token chunks and their input tokens into the buffers."""
        n, bs, nb = len(chunks), self.cache.block_size, self.num_blocks
        if not 0 < n <= self.num_rows:
            raise ValueError(f"FixedStep: {n} chunks for a step of {self.num_rows} rows")
        a = self._np
        table = a["table"].reshape(self.num_rows, nb)
        pos, slots = a["positions"][0], a["slots"]
        for i, c in enumerate(chunks):
            p = c.start
            need = p // bs + 1
            if c.length != 1 or need > nb or len(c.block_table) < need:
                raise ValueError(f"FixedStep: chunk {c} is not one token within {nb} blocks")
            row = table[i]
            row[:need] = c.block_table[:need]
            row[need:] = self.scratch_block
            pos[i] = p
            slots[i] = c.block_table[need - 1] * bs + p % bs
        a["ids"][0, :n] = token_ids[:n]
        self._pad(n)

    def load(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        heads: torch.Tensor | None = None,
    ) -> None:
        """Write one step's ``k`` real rows into the buffers: token ids, positions and write
        slots ``[k]``, block tables ``[k, <= blocks]``. The other rows are padding: token 0 at
        position 0 of the scratch block, which no sequence owns; the key counts (and, where
        attention reads them, the masks) follow from the positions (padding rows: key 0 only).
        ``heads``: the rows to return logits for, first in the buffer (the rest of it: row 0, its
        logits unread); None leaves the buffer as it is."""
        k, a = len(ids), self._np
        table_np = a["table"].reshape(self.num_rows, self.num_blocks)
        a["ids"][0, :k] = ids.numpy()
        a["positions"][0, :k] = pos.numpy()
        a["slots"][:k] = slots.numpy()
        table_np[:k, : table.shape[1]] = table.numpy()
        table_np[:k, table.shape[1] :] = self.scratch_block
        if heads is not None:
            a["heads"][:] = 0
            a["heads"][: len(heads)] = heads.numpy()
        self._pad(k)

    def _pad(self, k: int) -> None:
        """Rows from ``k`` on are padding; the key counts follow from the positions; then the
        values go to the device."""
        a = self._np
        a["ids"][0, k:] = 0
        a["positions"][0, k:] = 0
        a["slots"][k:] = self.scratch_block * self.cache.block_size
        a["table"].reshape(self.num_rows, self.num_blocks)[k:] = self.scratch_block
        a["lens"][:] = a["positions"][0] + 1
        self.upload()
        if self.masked:
            g = self.layout.decodes[0]
            g.mask.copy_((self._key_pos[None, :] <= self.positions[0][:, None])[:, None, None])

    def upload(self) -> None:
        """Copy the host values to the device buffers, without blocking (on a CPU, nothing: the
        host views are the buffers). The engine reads each step's sampled tokens on the host
        before it fills the next step, so a host buffer is never rewritten while its copy is in
        flight."""
        if self._buf is not self._host:
            for k, v in self._host.items():
                self._buf[k].copy_(v, non_blocking=True)


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, capped at ``limit`` (n itself must be <= limit)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


class FixedSteps:
    """All-decode steps on fixed shapes: CUDA graphs on a GPU, one compiled graph on a CPU, or
    the same shapes run as they are (what the tests exercise).

    A step in which every scheduled sequence decodes one token runs on a :class:`FixedStep` of
    ``rows x blocks``, both rounded up to a power of two (at most ``max_rows`` and
    ``max_blocks``): 37 sequences whose longest history spans 9 blocks run in the step for 64
    rows of 16 blocks. With ``graphs`` each shape is captured the first time it is needed (or
    ahead of time with :meth:`capture`), every graph in one memory pool. ``forward(ids,
    positions, step)`` returns the step's logits. ``path`` says what runs them.
    """

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
        self.steps = StepGraphs(
            lambda key: FixedStep(cache, key[0], key[1], scratch_block, masked=masked),
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
        """Build (capture, on a GPU) every (rows, blocks) step up to these sizes (default: the
        limits) ahead of time, largest first, so that timed runs never pay for a capture.
        Returns how many exist."""
        R = min(max_rows or self.max_rows, self.max_rows)
        NB = min(max_blocks or self.max_blocks, self.max_blocks)
        rows = sorted({bucket(n, self.max_rows) for n in range(1, R + 1)}, reverse=True)
        blocks = sorted({bucket(n, self.max_blocks) for n in range(1, NB + 1)}, reverse=True)
        return self.steps.capture([(r, b) for r in rows for b in blocks])

    @torch.inference_mode()
    def run_padding(self, rows: int) -> None:
        """Run the fixed-shape step of ``rows`` rows (a bucket) once, all padding: it writes only
        into the scratch block. A graph compiled in memory compiles here."""
        size = min(self.min_size, self.max_blocks)
        step = self.steps.entry((bucket(max(rows, self.min_size), self.max_rows), size))[0]
        self.forward(step.ids, step.positions, step)

    def run(self, chunks: Sequence[Any], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` for one decode step (``fits(chunks)`` must hold);
        ``chunks`` are the scheduler's (``.seq.block_table``) or :class:`SeqChunk` s."""
        fixed = [
            c if isinstance(c, SeqChunk) else SeqChunk(c.seq.block_table, c.start, 1)
            for c in chunks
        ]
        out = self.steps.run(self.key(chunks), lambda step: step.fill(fixed, token_ids))
        return out[: len(chunks)]


# ---- compiled ahead of time, kept on disk ------------------------------------------------------


def pool_over(k: list[torch.Tensor], v: list[torch.Tensor]) -> PagedKVCache:
    """A pool made of the given per-layer tensors (a compiled step's inputs), nothing allocated."""
    pool = PagedKVCache.__new__(PagedKVCache)
    pool.k, pool.v = k, v
    pool.num_blocks, pool.block_size, pool.n_kv_heads, pool.head_dim = k[0].shape
    pool.n_layers, pool.device, pool.dtype = len(k), k[0].device, k[0].dtype
    pool.kernel = serves_pool(k[0])
    return pool


class ExportedStep(nn.Module):
    """The fixed-shape step as a module ``torch.export`` can trace:
    ``(ids, positions, write_slots, table, mask, lens, heads, *pool_k, *pool_v)`` -> logits
    ``[heads, vocab]``, the pool written in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, positions, write_slots, table, mask, lens, heads, *pool: torch.Tensor):
        n = len(pool) // 2
        cache = pool_over(list(pool[:n]), list(pool[n:]))
        step = FixedStep.over(cache, ids, positions, write_slots, table, mask, lens, heads)
        return engine_forward(self.model, ids, positions, step)


def load_package(model: nn.Module, cache: PagedKVCache, log: Callable[[str], None] | None = None):
    """``forward(ids, positions, step)`` for the fixed-shape steps over ``cache``, from its package
    on disk (compiled and stored first if there is none): ``(forward, cached)``, or
    ``(None, False)`` where the model has no key or the step cannot be compiled ahead of time
    here (the caller then compiles it in memory). The rows and heads are symbols, one included:
    one package serves every batch, a batch of one unpadded, and both group sizes of the
    batch-invariant engine."""
    wrapper = ExportedStep(model)

    def compile(path: Path) -> None:
        # example sizes unlike any other size of the graph (heads, block size): a symbolic size
        # equal to another in the example would be taken for the same symbol
        step = FixedStep(cache, 7, 5, cache.num_blocks - 1, heads=13)
        rows = torch.export.Dim("rows", min=1, max=4096)
        heads = torch.export.Dim("heads", min=1, max=4096)
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
        aot.export_and_package(wrapper, model, args, shapes, path, log, "the engine's step")

    loaded, cached = aot.load_step(
        model, f"engine-heads-bs{cache.block_size}", wrapper, compile, log
    )
    if loaded is None:
        return None, False

    def forward(ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        return loaded(*step.inputs, *step.cache.k, *step.cache.v)

    return forward, cached


#: model -> its step compiled in memory; every engine on the same model shares one
_IN_MEMORY: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()


def compiled_forward(
    model: nn.Module, cache: PagedKVCache, log: Callable[[str], None] | None = None
) -> tuple[Callable, str, float | None, bool]:
    """The compiled fixed-shape step: ``(forward, path, compile seconds, in memory)``. From its
    package on disk for a model loaded from a file (:func:`load_package`), else one
    ``torch.compile`` graph in memory with every size symbolic, shared by every engine on the
    model and compiled at its first call
    (:meth:`llmlib.engine.run_mode.Steps.compile_now`)."""
    t0 = time.perf_counter()
    forward, cached = load_package(model, cache, log)
    if forward is not None:
        seconds = None if cached else time.perf_counter() - t0
        path = "compiled (from the cache)" if cached else "compiled (now, cached)"
        return forward, path, seconds, False
    if model not in _IN_MEMORY:
        _IN_MEMORY[model] = compile_step(engine_forward, model, dynamic=True)
    return functools.partial(_IN_MEMORY[model], model), "compiled (in memory)", None, True
