"""The model runner: one engine step's scheduled chunks through the model, and the sampled tokens.

Every chunk of a step, prefill and decode alike, goes into one row: the weight-matrix products see
all of the step's tokens at once (one pass over the weights per step), and the paged step computes
attention sequence by sequence (:meth:`~llmlib.engine.paged_cache.PagedStep.attend`), so packing
costs nothing in attention. The LM head runs only on the positions whose next token is sampled
(:meth:`llmlib.model.Transformer.hidden` then :meth:`~llmlib.model.Transformer.logits`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from llmlib.attention import AttendingCache
from llmlib.engine.graphs import PagedDecodeGraphs
from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.engine.sequence import ScheduledChunk
from llmlib.model import Transformer
from llmlib.sampling import sample


class ModelRunner:
    """Owns the paged KV pool; runs the scheduled chunks through the model and samples."""

    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        *,
        cuda_graphs: bool | None = None,
        max_graph_rows: int = 64,
        max_model_len: int | None = None,
    ) -> None:
        cfg = model.config
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        # With graphs the pool gets one block more than the block manager hands out: the scratch
        # block that a fixed-shape step's padding rows write into.
        self.cache = PagedKVCache(
            cfg.n_layers,
            num_blocks + (1 if cuda_graphs else 0),
            cfg.n_kv_heads,
            block_size,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self.graphs: PagedDecodeGraphs | None = None
        if cuda_graphs:
            max_len = max_model_len or cfg.max_seq_len
            self.graphs = PagedDecodeGraphs(
                self._forward_rows,
                self.cache,
                scratch_block=num_blocks,
                max_rows=max_graph_rows,
                max_blocks=-(-max_len // block_size),
                enabled=self.device.type == "cuda",
            )
        self.forward_passes = 0

    def _forward_rows(
        self, ids: torch.Tensor, positions: torch.Tensor, step: AttendingCache
    ) -> torch.Tensor:
        """The forward pass a fixed-shape decode step runs (and a CUDA graph records): logits [rows, V]."""
        return self.model.logits(self.model.hidden(ids, positions, step)[0])

    def _forward(self, chunks: list[ScheduledChunk], select: list[int]) -> torch.Tensor:
        """One forward pass over ``chunks`` packed into one row; logits [len(select), V]."""
        ids: list[int] = []
        for c in chunks:
            ids += c.seq.token_ids[c.start : c.start + c.length]
        seq_chunks = [SeqChunk(c.seq.block_table, c.start, c.length) for c in chunks]
        return self.forward_packed(seq_chunks, ids, select)

    def forward_packed(
        self, chunks: list[SeqChunk], ids: list[int], select: list[int]
    ) -> torch.Tensor:
        """The forward pass itself, on block tables and token ids alone (what a tensor-parallel
        worker, which has no sequences, runs too): logits [len(select), V] at ``select``."""
        step = self.cache.step([chunks])
        self.forward_passes += 1
        ids_t = torch.tensor([ids], dtype=torch.long).to(self.device)
        sel = torch.as_tensor(select, dtype=torch.long).to(self.device)
        h = self.model.hidden(ids_t, step.positions, step)
        # the LM head (vocab x d_model) only where a token is sampled: the last of each prompt
        return self.model.logits(h[0].index_select(0, sel))

    @torch.inference_mode()
    def execute(
        self, chunks: Seq[ScheduledChunk], generators: dict[int, torch.Generator | None]
    ) -> dict[int, int]:
        """Run one step's chunks; return ``{seq_id: sampled token}`` for chunks that reach their end.

        Every chunk, prefill and decode alike, goes into one row: the weight-matrix products see
        all of the step's tokens at once (one pass over the weights per step), and the paged step
        computes attention sequence by sequence (:meth:`~llmlib.engine.paged_cache.PagedStep.attend`), so
        packing costs nothing in attention. Prefill chunks first, then decode ones.
        """
        if self.graphs is not None and self.graphs.fits(chunks):
            # every sequence decodes one token: the fixed-shape step (a CUDA graph replay on a GPU)
            self.forward_passes += 1
            logits = self.graphs.run(chunks, [c.seq.token_ids[c.start] for c in chunks])
            keep = [
                i for i, c in enumerate(chunks) if c.samples
            ]  # a 1-token slice of a prompt samples nothing
            return self._sample([chunks[i] for i in keep], logits[keep], generators)
        order = [c for c in chunks if c.length > 1] + [c for c in chunks if c.length == 1]
        ends, sampled, t = [], [], 0
        for c in order:
            t += c.length
            if c.samples:  # sample at the last token of every chunk that completes its sequence
                ends.append(t - 1)
                sampled.append(c)
        logits = self._forward(order, ends or [t - 1])  # a step of partial prompts samples nothing
        return self._sample(sampled, logits, generators)

    def _sample(
        self,
        sampled: list[ScheduledChunk],
        logits: torch.Tensor,
        generators: dict[int, torch.Generator | None],
    ) -> dict[int, int]:
        if not sampled:
            return {}
        logits = logits.float()
        params = [c.seq.params for c in sampled]
        gens = [generators.get(c.seq.seq_id) for c in sampled]
        seen = (
            [c.seq.token_ids for c in sampled]
            if any(p.repetition_penalty != 1.0 for p in params)
            else None
        )
        toks = sample(logits, params, gens, seen).tolist()
        return {c.seq.seq_id: t for c, t in zip(sampled, toks)}
