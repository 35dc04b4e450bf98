"""Speculative decoding in the batching engine: a cheap proposer drafts, the step verifies.

Before each step, every decoding sequence gets up to k draft tokens. The scheduler gives them
slots (:meth:`~llmlib.engine.block_manager.BlockManager.append_slots` with a lookahead), the
runner scores them in the same forward pass as the other sequences' work and keeps those the
model agrees with (:meth:`~llmlib.engine.runner.ModelRunner._verify`), and the scheduler returns
the blocks only refused drafts held (:meth:`~llmlib.engine.block_manager.BlockManager.trim`).

Three proposers, as in :mod:`llmlib.speculative`:

* ``ngram``: prompt lookup (:func:`llmlib.speculative.proposers.lookup`), before scheduling;
* ``early_exit``: the model's first layers, final norm and LM head, over the target's pool (for
  verified tokens those layers' keys and values are the draft's; verification overwrites the rest);
* ``draft``: a smaller model with the same vocabulary, its own pool under the same block tables.

Under sampling, drafts are drawn with the request's params and verified by rejection sampling, so
the output keeps the model's distribution. Sequences whose next token depends on more decode
plainly: penalties and logit bias, log-probabilities, structured output, ``min_tokens`` not out.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.engine.sequence import ScheduledChunk, Sequence
from llmlib.sampling import draw
from llmlib.speculative.config import SpeculativeConfig
from llmlib.speculative.proposers import lookup
from llmlib.speculative.verify import distributions


def _plain(seq: Sequence) -> bool:
    """Whether ``seq`` decodes without speculation this step."""
    p = seq.params
    return (
        seq.num_computed_tokens != seq.num_tokens - 1
        or seq.num_output_tokens == 0
        or bool(seq.forks)
        or seq.matcher is not None
        or p.penalized
        or p.logprobs is not None
        or seq.num_output_tokens < p.min_tokens
    )


class EngineSpeculator:
    """Proposals for the running sequences of a batching engine."""

    def __init__(self, spec: SpeculativeConfig, model: Any = None, cache: Any = None) -> None:
        self.spec = spec
        self.draft: _PagedDraft | None = None
        if spec.method == "early_exit":
            n = model.config.n_layers
            if not 1 <= spec.exit_layer <= n:
                raise ValueError(f"early_exit: exit_layer must be in 1..{n}, got {spec.exit_layer}")
            self.draft = _PagedDraft(model, cache, n_layers=spec.exit_layer)
        elif spec.method == "draft":
            self.draft = _PagedDraft.of_model(spec.draft_model, model, cache)

    def propose(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Set ``draft_tokens`` on every running sequence (empty: it decodes plainly): prompt
        lookup's proposals, or placeholders for a model's drafts (:meth:`fill` fills them in)."""
        s = self.spec
        for seq in running:
            seq.draft_tokens = []
            if _plain(seq):
                continue
            k = min(
                s.num_speculative_tokens,
                seq.max_tokens - seq.num_output_tokens - 1,
                max_model_len - seq.num_tokens - 1,
            )
            if k <= 0:
                continue
            if self.draft is None:
                seq.draft_tokens = lookup(
                    seq.token_ids, k, s.prompt_lookup_min, s.prompt_lookup_max
                )
            else:
                seq.draft_tokens = [0] * k

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Finished sequences: a draft model's pool no longer keeps track of them."""
        if self.draft is not None:
            self.draft.forget(seq_ids)

    def fill(self, chunks: Seq[ScheduledChunk], generators: dict[int, Any]) -> None:
        """After scheduling: a model drafts the tokens of every chunk that was given slots."""
        if self.draft is not None:
            todo = [c for c in chunks if c.draft]
            if todo:
                self.draft.run(todo, generators)


class _PagedDraft:
    """A model (the target's first layers, or a draft) decoding k tokens for a batch over a pool."""

    def __init__(
        self, model: Any, cache: PagedKVCache, n_layers: int | None = None, own: bool = False
    ) -> None:
        self.model, self.cache, self.n_layers, self.own = model, cache, n_layers, own
        self.device = cache.device
        self._held: dict[int, list[int]] = {}  # own pool: the tokens it holds, per sequence

    @classmethod
    def of_model(cls, draft: Any, target: Any, target_cache: PagedKVCache) -> _PagedDraft:
        if not isinstance(draft, torch.nn.Module):
            from llmlib.checkpoints import load_model

            draft = load_model(draft, device=target.device, dtype=target.dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                f"target's ({target.config.vocab_size}): their token ids would not mean the same"
            )
        c = draft.config
        pool = PagedKVCache(
            c.n_layers,
            target_cache.num_blocks,
            c.n_kv_heads,
            target_cache.block_size,
            c.head_dim,
            device=target_cache.device,
            dtype=draft.dtype,
        )
        return cls(draft, pool, own=True)

    def _pass(self, chunks: list[SeqChunk], ids: list[int], last: list[int]) -> torch.Tensor:
        """One forward pass over ``chunks`` packed in a row: logits at the rows ``last``."""
        step = self.cache.step([chunks])
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)
        h = self.model.hidden(ids_t, step.positions, step, n_layers=self.n_layers)
        sel = torch.tensor(last, dtype=torch.long, device=self.device)
        return self.model.logits(h[0].index_select(0, sel))

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], generators: dict[int, Any]) -> None:
        if self.own:
            self._catch_up(chunks)
        ks = [len(c.draft) for c in chunks]
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            fed = [chunks[i].seq.token_ids[-1] if j == 0 else tokens[i][-1] for i in live]
            pieces = [SeqChunk(chunks[i].seq.block_table, chunks[i].start + j, 1) for i in live]
            logits = self._pass(pieces, fed, list(range(len(live)))).float()
            for row, i in enumerate(live):
                seq = chunks[i].seq
                if seq.params.greedy:
                    tokens[i].append(int(logits[row].argmax()))
                    continue
                q = distributions(logits[row : row + 1], seq.params)
                tokens[i].append(int(draw(q, [generators.get(seq.seq_id)])[0]))
                probs[i].append(q[0])
        for c, t, q in zip(chunks, tokens, probs):
            c.draft = t
            c.draft_probs = torch.stack(q) if q else None
            if self.own:  # fed: every token up to the pending one, then all drafts but the last
                self._held[c.seq.seq_id] = c.seq.token_ids + t[:-1]

    def _catch_up(self, chunks: list[ScheduledChunk]) -> None:
        """Feed each sequence's draft pool the tokens it has not seen, up to the pending one."""
        pieces, ids = [], []
        for c in chunks:
            seq = c.seq
            held = self._held.get(seq.seq_id, [])
            n = 0
            limit = min(len(held), c.start)
            while n < limit and held[n] == seq.token_ids[n]:
                n += 1
            if n < c.start:
                pieces.append(SeqChunk(seq.block_table, n, c.start - n))
                ids += seq.token_ids[n : c.start]
        if pieces:
            self._pass(pieces, ids, [len(ids) - 1])

    def forget(self, seq_ids: Iterable[int]) -> None:
        for s in seq_ids:
            self._held.pop(s, None)


def engine_speculator(
    spec: SpeculativeConfig | None, sharded: bool, model: Any = None, cache: Any = None
) -> EngineSpeculator | None:
    if spec is None:
        return None
    if not isinstance(spec, SpeculativeConfig):
        raise TypeError(
            f"speculative_config must be a SpeculativeConfig, got {type(spec).__name__}"
        )
    if sharded:
        raise ValueError("LLM: speculative decoding with tensor_parallel_size > 1 is not supported")
    return EngineSpeculator(spec, model, cache)
