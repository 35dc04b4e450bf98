"""The model runner: one engine step's scheduled chunks through the model, and the sampled tokens.

Every chunk of a step, prefill and decode alike, goes into one row: the weight-matrix products see
all of the step's tokens at once (one pass over the weights per step), and the paged step computes
attention sequence by sequence (:meth:`~llmlib.engine.paged_cache.PagedStep.attend`), so packing
costs nothing in attention. The LM head runs only on the positions whose next token is sampled
(:meth:`llmlib.model.Transformer.hidden` then :meth:`~llmlib.model.Transformer.logits`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from llmlib.engine.fixed_step import FixedSteps
from llmlib.engine.outputs import TokenLogprob
from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.engine.run_mode import pick_steps, scratch_blocks
from llmlib.engine.sequence import ScheduledChunk
from llmlib.engine.stopping import constrain
from llmlib.model import Transformer
from llmlib.sampling import sample
from llmlib.speculative.verify import accept_greedy, accept_sampled, distributions

#: the most tokens a step runs as rows of the fixed-shape step (the compiled step's rows are a
#: symbol up to 4096)
MAX_TOKEN_ROWS = 4096


class ModelRunner:
    """Owns the paged KV pool; runs the scheduled chunks through the model and samples.

    ``mode`` is the engine's run mode (:data:`llmlib.engine.config.RUN_MODES`), turned into the
    :class:`~llmlib.engine.fixed_step.Steps` that run every step by
    :func:`~llmlib.engine.fixed_step.pick_steps`; ``max_rows`` bounds a fixed-shape step (the
    engine's sequences per step) and ``max_model_len`` its history."""

    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        *,
        mode: str = "eager",
        max_rows: int = 64,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        from llmlib.runtime.aot import print_progress

        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, model.dtype
        # A fixed-shape step's padding rows write into a scratch block: one block more than the
        # block manager hands out.
        self.cache = PagedKVCache(
            cfg.n_layers,
            num_blocks + scratch_blocks(mode),
            cfg.n_kv_heads,
            block_size,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.mode = mode
        max_blocks = -(-(max_model_len or cfg.max_seq_len) // block_size)
        self.steps = pick_steps(
            mode, model, self.cache, scratch_block=num_blocks, max_rows=max_rows,
            max_blocks=max_blocks, log=print_progress,
        )  # fmt: skip
        self.model = self.steps.model
        self.forward_passes = 0

    @property
    def graphs(self) -> FixedSteps | None:
        """The fixed-shape all-decode steps (None: every step runs eagerly)."""
        return self.steps.decode

    @property
    def rows(self) -> Any:
        """The compiled batch-invariant groups (None: not this mode)."""
        return self.steps.rows

    @property
    def batch_invariant(self) -> bool:
        return self.steps.invariant

    @property
    def decode_path(self) -> str:
        """Which step runs: ``"eager"``, or the compiled one and where it came from."""
        return self.steps.path

    @property
    def compile_s(self) -> float | None:
        """Seconds compiling the step took in this process (None: loaded, or none)."""
        return self.steps.compile_s

    def compile_now(self, rows: int) -> float | None:
        """Compile a step compiled in memory now, before any request waits
        (:meth:`~llmlib.engine.fixed_step.Steps.compile_now`)."""
        return self.steps.compile_now(rows)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` (a forked sequence's copy-on-write; every rank under TP)."""
        self.cache.copy_blocks(pairs)

    def _forward(self, chunks: list[ScheduledChunk], select: list[int]) -> torch.Tensor:
        """One forward pass over ``chunks`` packed into one row; logits [len(select), V]."""
        ids: list[int] = []
        for c in chunks:
            ids += c.seq.token_ids[c.start : c.start + c.length] + c.draft
        seq_chunks = [
            SeqChunk(c.seq.block_table, c.start, c.length + len(c.draft), c.seq.num_prompt_tokens)
            for c in chunks
        ]
        return self.forward_packed(seq_chunks, ids, select)

    def forward_packed(
        self, chunks: list[SeqChunk], ids: list[int], select: list[int]
    ) -> torch.Tensor:
        """The forward pass itself, on block tables and token ids alone (what a tensor-parallel
        worker, which has no sequences, runs too): logits [len(select), V] at ``select``."""
        if self.rows is not None:  # batch-invariant, compiled: every token a row of a group
            self.forward_passes += 1
            return self.rows.run(chunks, ids, select)
        tokens = self.steps.tokens
        if tokens is not None and tokens.serves_tokens(chunks, MAX_TOKEN_ROWS):
            self.forward_passes += 1  # prompt chunks and decode rows, one fixed-shape step
            return tokens.run_tokens(chunks, ids, select)
        if self.batch_invariant:
            from llmlib.engine.invariant import InvariantStep

            step = InvariantStep(self.cache, [chunks])
        else:
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
    ) -> StepResult:
        """Run one step's chunks; sample a token for every chunk that reaches its sequence's end.

        Every chunk, prefill and decode alike, goes into one row: the weight-matrix products see
        all of the step's tokens at once (one pass over the weights per step), and the paged step
        computes attention sequence by sequence (:meth:`~llmlib.engine.paged_cache.PagedStep.attend`), so
        packing costs nothing in attention. Prefill chunks first, then decode ones. A sequence
        that asked for prompt log-probabilities has the LM head run at every prompt position of
        its chunk too.
        """
        res = StepResult()
        wants_prompt = any(_prompt_positions(c) for c in chunks)
        drafts = any(c.draft for c in chunks)
        if self.graphs is not None and not (wants_prompt or drafts) and self.graphs.fits(chunks):
            # every sequence decodes one token: the fixed-shape step (a CUDA graph replay on a GPU)
            self.forward_passes += 1
            logits = self.graphs.run(chunks, [c.seq.token_ids[c.start] for c in chunks])
            keep = [i for i, c in enumerate(chunks) if c.samples]  # a prompt's 1-token slice: none
            if len(keep) < len(chunks):
                chunks, logits = [chunks[i] for i in keep], logits[keep]
            self._sample(list(chunks), logits, generators, res)
            return res
        plan = StepPlan.of(chunks)
        logits = self._forward(plan.order, plan.select)
        sampled, prompt, verified = plan.split(logits)
        self._sample(plan.sampled, sampled, generators, res)
        row = 0
        for c, pos in plan.prompt:
            lp = prompt[row : row + len(pos)].float().log_softmax(-1)
            row += len(pos)
            nxt = [c.seq.token_ids[p + 1] for p in pos]
            entries = _logprob_entries(lp, nxt, c.seq.params.prompt_logprobs)
            res.prompt_logprobs[c.seq.seq_id] = list(zip([p + 1 for p in pos], entries))
        self._verify(plan.verified, verified, generators, res)
        return res

    def _verify(
        self,
        chunks: list[ScheduledChunk],
        logits: torch.Tensor,
        generators: dict[int, torch.Generator | None],
        res: StepResult,
    ) -> None:
        """Speculative decoding: keep each sequence's proposals the model agrees with
        (:mod:`llmlib.speculative.verify`); its own token after them is the step's token."""
        row = 0
        for c in chunks:
            rows = logits[row : row + 1 + len(c.draft)]
            row += 1 + len(c.draft)
            params = c.seq.params
            if params.greedy:
                a, nxt = accept_greedy(c.draft, rows)
            else:  # against the proposer's distribution (None: prompt lookup's one-hot draft)
                probs = distributions(rows, params)
                gen = generators.get(c.seq.seq_id)
                a, nxt = accept_sampled(c.draft, c.draft_probs, probs, gen)
            res.accepted[c.seq.seq_id] = c.draft[:a]
            res.tokens[c.seq.seq_id] = nxt

    def _sample(
        self,
        sampled: list[ScheduledChunk],
        logits: torch.Tensor,
        generators: dict[int, torch.Generator | None],
        res: StepResult,
    ) -> None:
        if not sampled:
            return
        # n > 1: at the end of its prompt a sequence samples once for itself and once per fork,
        # all from the same row of logits
        seqs, rows = [], []
        for i, c in enumerate(sampled):
            group = [c.seq, *c.seq.forks] if c.seq.num_output_tokens == 0 else [c.seq]
            seqs += group
            rows += [i] * len(group)
        raw = logits  # in the model's dtype: sampling converts only where it needs to
        if len(rows) != len(sampled):
            raw = raw[torch.tensor(rows, device=raw.device)]
        params = [s.params for s in seqs]
        logits = constrain(raw, seqs)
        penalized = any(p.penalized for p in params)
        seen = [s.token_ids for s in seqs] if penalized else None
        outs = [s.output_token_ids for s in seqs] if penalized else None
        gens = [generators.get(s.seq_id) for s in seqs]
        toks = sample(logits, params, gens, seen, outs).tolist()
        res.tokens.update({s.seq_id: t for s, t in zip(seqs, toks)})
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = raw[torch.tensor(want, device=raw.device)].float().log_softmax(-1)
            k = max(params[i].logprobs for i in want)
            entries = _logprob_entries(lp, [toks[i] for i in want], k)
            for i, e in zip(want, entries):
                e.top = e.top[: params[i].logprobs]
                res.logprobs[seqs[i].seq_id] = e


@dataclass
class StepPlan:
    """Which rows of one step's packed tokens get logits, in three named groups.

    ``order`` is the step's chunks as they are packed (prompt chunks first, then single tokens).
    The LM head runs at ``select``, the concatenation of:

    * ``sampled_rows``: the last token of every chunk that completes its sequence (``sampled``,
      one next token each);
    * ``prompt_rows``: every prompt position of a chunk whose request asked for prompt
      log-probabilities (``prompt``: the chunk and its positions);
    * ``verified_rows``: speculative decoding's pending token and its proposals (``verified``).

    A step of partial prompts samples nothing, but the model still runs: it selects the last row,
    whose logits nobody reads.
    """

    order: list[ScheduledChunk]
    sampled: list[ScheduledChunk]
    sampled_rows: list[int]
    prompt: list[tuple[ScheduledChunk, list[int]]]
    prompt_rows: list[int]
    verified: list[ScheduledChunk]
    verified_rows: list[int]
    last_row: int

    @classmethod
    def of(cls, chunks: Seq[ScheduledChunk]) -> StepPlan:
        order = [c for c in chunks if c.length > 1] + [c for c in chunks if c.length == 1]
        plan = cls(order, [], [], [], [], [], [], 0)
        t = 0  # the packed row of the chunk's first token
        for c in order:
            if pos := _prompt_positions(c):
                plan.prompt.append((c, pos))
                plan.prompt_rows += [t + p - c.start for p in pos]
            if c.draft:
                plan.verified.append(c)
                plan.verified_rows += range(t, t + 1 + len(c.draft))
                t += 1 + len(c.draft)
                continue
            t += c.length
            if c.samples:
                plan.sampled.append(c)
                plan.sampled_rows.append(t - 1)
        plan.last_row = t - 1
        return plan

    @property
    def select(self) -> list[int]:
        rows = self.sampled_rows + self.prompt_rows + self.verified_rows
        return rows or [self.last_row]

    def split(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logits at :attr:`select` -> (sampled, prompt, verified) rows."""
        a, b = len(self.sampled_rows), len(self.prompt_rows)
        return logits[:a], logits[a : a + b], logits[a + b : a + b + len(self.verified_rows)]


@dataclass
class StepResult:
    """What one step produced: a token per sampling sequence (forks included), and the
    log-probabilities asked for (``prompt_logprobs`` as ``(prompt position, entry)`` pairs)."""

    tokens: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, list[int]] = field(default_factory=dict)  # kept proposals, before tokens
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)


def _prompt_positions(c: ScheduledChunk) -> list[int]:
    """Positions of this chunk whose logits score a prompt token (when the sequence asks)."""
    seq = c.seq
    if seq.params is None or seq.params.prompt_logprobs is None:
        return []
    end = min(c.start + c.length, seq.num_prompt_tokens - 1)
    return list(range(c.start, end))


def _logprob_entries(lp: torch.Tensor, chosen: list[int], k: int) -> list[TokenLogprob]:
    """Per row of log-probabilities [R, V]: the chosen token's, its rank, and the top ``k``."""
    idx = torch.tensor(chosen, device=lp.device).unsqueeze(1)
    picked = lp.gather(1, idx)
    ranks = (lp > picked).sum(1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    out = []
    for r, (t, v, rank) in enumerate(zip(chosen, picked[:, 0].tolist(), ranks.tolist())):
        top = list(zip(top_i[r].tolist(), top_v[r].tolist()))
        out.append(TokenLogprob(t, v, rank, top))
    return out
