"""The batching engine's decode steps on fixed shapes: replayed from CUDA graphs, or compiled.

A step in which every running sequence decodes one token is a few hundred tiny kernels; on a GPU
the CPU's launching them, not the GPU's running them, sets the pace at small batches. A CUDA graph
records the step once and replays it with one launch (:mod:`llmlib.runtime.graphs`). It replays
exactly the recorded kernels on exactly the recorded memory, so the step must have a fixed shape
and every index tensor a fixed address: :class:`StaticDecodeStep` is such a step over the paged
pool (rows x blocks, both rounded up to a power of two), and :class:`PagedDecodeGraphs` keeps one
per shape, captured the first time it is needed.

On the CPU the same fixed-shape steps run eagerly (nothing to capture), which is what the tests
exercise, or compiled (``LLM(compile=True)``): one graph with symbolic sizes serves every bucket
(:func:`llmlib.runtime.compile.compile_engine_step`), so inductor fuses each layer's small operators and,
for bfloat16 or quantized weights, picks its own matrix kernels, as it does for the batch-1
decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmlib.engine.paged_cache import DecodeGroup, PagedKVCache, SeqChunk, StepLayout, paged_attend
from llmlib.model.attention import AttentionSpec
from llmlib.runtime.graphs import StepGraphs


class StaticDecodeStep:
    """A decode-only step with fixed shapes and fixed addresses, which a CUDA graph can replay.

    ``rows`` sequences of one new token each, every one attending over ``blocks`` blocks. All the
    step's index tensors (token ids, positions, write slots, block table, mask) are allocated once
    in a :class:`~llmlib.engine.paged_cache.StepLayout`; :meth:`fill` copies each new step's values
    into them, so a graph captured over this step reads the new values on replay. Rows past the
    real ones are padding: they write into ``scratch_block``, a block the block manager never hands
    out, and read only its first slot. Attention is the paged step's own
    (:func:`~llmlib.engine.paged_cache.paged_attend`) over this layout.

    Only the rows the ``heads`` buffer names get logits (by default every row, in order): a
    group of prompt tokens samples a few of its rows, and the LM head, a product as wide as the
    vocabulary, is a large part of a small model's work.
    """

    def __init__(
        self, cache: PagedKVCache, rows: int, blocks: int, scratch_block: int, heads: int = 0
    ) -> None:
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"StaticDecodeStep: scratch block {scratch_block} is not in the pool")
        dev, bs = cache.device, cache.block_size
        self.cache = cache
        self.num_rows, self.num_blocks, self.scratch_block = rows, blocks, scratch_block
        self.ids = torch.zeros((1, rows), dtype=torch.long, device=dev)
        table = torch.full((rows * blocks,), scratch_block, dtype=torch.long, device=dev)
        mask = torch.zeros((rows, 1, 1, blocks * bs), dtype=torch.bool, device=dev)
        mask[..., 0] = True
        group = DecodeGroup(
            torch.zeros(rows, dtype=torch.long, device=dev),
            torch.arange(rows, device=dev),
            table,
            blocks,
            mask,
            torch.ones(rows, dtype=torch.long, device=dev),  # keys per row, for the CPU kernel
        )
        self.layout = StepLayout(
            positions=torch.zeros((1, rows), dtype=torch.long, device=dev),
            write_slots=torch.full((rows,), scratch_block * bs, dtype=torch.long, device=dev),
            write_index=None,
            prefills=[],
            decodes=[group],
        )
        self._key_pos = torch.arange(blocks * bs)
        #: the rows whose logits the step returns, in order (an export's example may ask for
        #: more heads than rows: its indices wrap)
        self.heads = torch.arange(heads or rows, device=dev) % rows

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
    ) -> StaticDecodeStep:
        """A step over the given buffers (``table`` as ``[rows, blocks]``): what a step compiled
        ahead of time receives as its inputs (:mod:`llmlib.runtime.aot`)."""
        step = cls.__new__(cls)
        rows, blocks = table.shape
        step.cache, step.ids, step.num_rows, step.num_blocks = cache, ids, rows, blocks
        zeros = torch.zeros_like(lens)
        rows_ix = torch.arange(rows, device=ids.device)
        group = DecodeGroup(zeros, rows_ix, table.reshape(-1), blocks, mask, lens)
        step.layout = StepLayout(positions, write_slots, None, [], [group])
        step.heads = heads
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
        """The paged step's attention over this layout; a sliding window is a mask computed
        from the position buffer on the device, so a captured graph applies it on every replay."""
        return paged_attend(self.cache, self.layout, layer, q, k, v, spec)

    def fill(self, chunks: Sequence[SeqChunk], token_ids: Sequence[int]) -> None:
        """Copy one step's decode chunks (``length == 1``) and their input tokens into the buffers."""
        n, bs, nb = len(chunks), self.cache.block_size, self.num_blocks
        if not 0 < n <= self.num_rows:
            raise ValueError(f"StaticDecodeStep: {n} chunks for a step of {self.num_rows} rows")
        pos = torch.tensor([c.start for c in chunks], dtype=torch.long)
        table = torch.full((n, nb), self.scratch_block, dtype=torch.long)
        for i, c in enumerate(chunks):
            need = c.start // bs + 1
            if c.length != 1 or need > nb or len(c.block_table) < need:
                raise ValueError(f"StaticDecodeStep: chunk {c} is not one token within {nb} blocks")
            table[i, :need] = torch.as_tensor([int(x) for x in c.block_table[:need]])
        slots = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        self.load(torch.as_tensor(list(token_ids[:n]), dtype=torch.long), pos, slots, table)

    def load(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        heads: torch.Tensor | None = None,
    ) -> None:
        """Copy one step's ``k`` real rows into the buffers: token ids, positions and write slots
        ``[k]``, block tables ``[k, <= blocks]``. The other rows are padding: token 0 at position
        0 of the scratch block, which no sequence owns; the mask and key counts follow from the
        positions (padding rows: key 0 only). ``heads``: the rows to return logits for, first in
        the buffer (the rest of it: row 0, its logits unread); None leaves the buffer as it is."""
        k, R, bs = len(ids), self.num_rows, self.cache.block_size
        full = torch.zeros((2, R), dtype=torch.long)  # ids, positions
        full[0, :k], full[1, :k] = ids, pos
        all_slots = torch.full((R,), self.scratch_block * bs, dtype=torch.long)
        all_slots[:k] = slots
        all_table = torch.full((R, self.num_blocks), self.scratch_block, dtype=torch.long)
        all_table[:k, : table.shape[1]] = table
        group = self.layout.decodes[0]
        self.ids.copy_(full[0][None])
        self.layout.positions.copy_(full[1][None])
        self.layout.write_slots.copy_(all_slots)
        group.table.copy_(all_table.view(-1))
        group.mask.copy_((self._key_pos[None, :] <= full[1][:, None])[:, None, None, :])
        group.lens.copy_(full[1] + 1)
        if heads is not None:
            self.heads.zero_()[: len(heads)] = heads


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, capped at ``limit`` (n itself must be <= limit)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


class PagedDecodeGraphs:
    """The batching engine's decode steps on fixed shapes (``llmlib.LLM``): CUDA graphs on a GPU
    (:class:`llmlib.runtime.graphs.StepGraphs`), one ``torch.compile`` graph on a CPU that asks.

    A step in which every scheduled sequence decodes one token is run on a
    :class:`StaticDecodeStep` of ``rows x blocks``, both rounded up to a power
    of two (at most ``max_rows`` and ``max_blocks``): a batch of 37 sequences whose longest history
    spans 9 blocks runs in the step for 64 rows of 16 blocks. One graph per such pair is captured
    the first time it is needed (or ahead of time with :meth:`capture`); every graph shares one
    memory pool. Steps that hold a prompt chunk, or exceed the limits, run eagerly.

    ``forward(ids, positions, step)`` is the engine's forward pass, returning ``[rows, vocab]``
    logits. With ``enabled=False`` (the default off CUDA) the same fixed-shape steps run eagerly
    without capture, which is what the CPU tests exercise.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        cache: Any,
        scratch_block: int,
        max_rows: int,
        max_blocks: int,
        enabled: bool | None = None,
        warmup: int = 2,
        min_size: int = 1,
    ) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(
                f"PagedDecodeGraphs: max_rows ({max_rows}) and max_blocks ({max_blocks}) must be >= 1"
            )
        self.forward, self.cache, self.scratch_block = forward, cache, scratch_block
        self.max_rows, self.max_blocks = max_rows, max_blocks
        # a compiled forward traces sizes as symbols, except a size of 1, which it would compile
        # a second graph for: such a step pads one row (or block) more
        self.min_size = min_size
        self.enabled = (cache.device.type == "cuda") if enabled is None else bool(enabled)
        if self.enabled and cache.device.type != "cuda":
            raise ValueError("PagedDecodeGraphs: CUDA graphs need the KV pool on a CUDA device")
        self.steps = StepGraphs(
            lambda key: StaticDecodeStep(cache, key[0], key[1], scratch_block),
            lambda s: forward(s.ids, s.positions, s),
            cache.device,
            self.enabled,
            warmup,
        )

    @property
    def _entries(self) -> dict:
        return self.steps.entries

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
        """Capture ahead of time every (rows, blocks) step up to these sizes (default: the limits),
        largest first, so that timed runs never pay for a capture. Returns how many exist."""
        R = min(max_rows or self.max_rows, self.max_rows)
        NB = min(max_blocks or self.max_blocks, self.max_blocks)
        rows = sorted({bucket(n, self.max_rows) for n in range(1, R + 1)}, reverse=True)
        blocks = sorted({bucket(n, self.max_blocks) for n in range(1, NB + 1)}, reverse=True)
        return self.steps.capture([(r, b) for r in rows for b in blocks])

    @torch.inference_mode()
    def run_padding(self, rows: int) -> None:
        """Run the fixed-shape step of ``rows`` rows (a bucket) once, all padding: it writes only
        into the scratch block. A compiled forward compiles here, before any request waits."""
        size = min(self.min_size, self.max_blocks)
        step = self.steps.entry((bucket(max(rows, self.min_size), self.max_rows), size))[0]
        self.forward(step.ids, step.positions, step)

    def run(self, chunks: Sequence[Any], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` for one decode step (``fits(chunks)`` must hold)."""
        fixed = [SeqChunk(c.seq.block_table, c.start, 1) for c in chunks]
        out = self.steps.run(self.key(chunks), lambda step: step.fill(fixed, token_ids))
        return out[: len(chunks)]
