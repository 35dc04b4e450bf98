"""The scheduler: which sequences run in the next forward pass, and how many tokens each (chapter 10).

Every sequence is described by one number, how many of its tokens already have keys/values in
the cache (``num_computed_tokens``). A step computes the next chunk of tokens of each scheduled
sequence: the whole prompt of a new request (prefill), or the single token sampled last step
(decode), or a piece of a long prompt (chunked prefill). Prefill and decode are the same thing at
different chunk lengths, so one step can mix them; a *token budget* per step bounds the work.

Order of service in a step:

1. running sequences, oldest first (the one token each of decode is cheap and keeps latency
   steady). A sequence whose last block is full needs a new one; when none is free, the
   *newest* running sequence is preempted: its blocks are freed and it goes back to the front of
   the waiting queue, to be recomputed later from its tokens (which are kept). Its prefix blocks
   usually survive in the prefix cache, so recompute is often cheap.
2. waiting sequences, first come first served, while the budget, ``max_num_seqs`` and free
   blocks allow (none are admitted in a step that had to preempt). A prompt is admitted only if
   the pool keeps a block of headroom for every running sequence afterwards: sequences grow a
   block every ``block_size`` tokens, and filling the pool to the brim just schedules a
   preemption (a full recompute) a few steps later.

A sequence finishes where :mod:`llmlib.engine.stopping` says, checked as each token is appended
(an end token, a stop string, a finished grammar, ``max_tokens``, the model's length limit), or
when the engine aborts it (:meth:`Scheduler.finish`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from llmlib.engine.block_manager import BlockManager, PrefixPending
from llmlib.engine.sequence import ScheduledChunk, Sequence, SequenceStatus
from llmlib.engine.stopping import prompt_only, take


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens computed as (part of) a prompt or a recompute
    decode_tokens: int = 0  # tokens computed one per sequence per step
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead
    preemptions: int = 0
    finished: int = 0
    spec_proposed: int = 0  # speculative decoding: proposals verified, and of those kept
    spec_accepted: int = 0


class Scheduler:
    """Waiting and running queues, a per-step token budget, preemption by recompute."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        headroom_blocks_per_seq: int = 1,
    ) -> None:
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}"
            )
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        capacity = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.enable_chunked_prefill = enable_chunked_prefill
        # Keep a few blocks free when admitting, so the sequences just admitted can decode a while
        # before the first preemption (a full pool would preempt on the very next step).
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        # And admit a prompt only if every running sequence, the new one included, could still
        # take ``headroom_blocks_per_seq`` more blocks: a full pool means a preemption a few steps
        # later, and a preempted sequence is recomputed from scratch, whereas a prompt left
        # waiting costs nothing (`llmlib bench batching` counts the preemptions either way).
        if not isinstance(headroom_blocks_per_seq, int) or headroom_blocks_per_seq < 0:
            raise ValueError(
                f"headroom_blocks_per_seq must be a non-negative integer, got {headroom_blocks_per_seq!r}"
            )
        self.headroom_blocks_per_seq = headroom_blocks_per_seq
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # ---- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens + seq.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) exceeds the "
                f"maximum sequence length {self.max_model_len}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (any state): free its blocks and drop it from the queues."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free_seq(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        if seq.text is not None and reason != "abort":
            seq.text.close()  # no more tokens: a dangling partial character is flushed
        self.stats.finished += 1

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it first in line, to be recomputed."""
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        """Choose this step's work: a chunk per scheduled sequence, within the token budget."""
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        preempted = False

        # 1. Running sequences, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # speculative proposals ride along when the budget and the pool have room for them
            n = seq.num_tokens - seq.num_computed_tokens
            draft = seq.draft_tokens if n == 1 and n + len(seq.draft_tokens) <= budget else []
            if draft:  # never at the price of a preemption: leave a block for each one after
                need = self.bm.blocks_for(seq.num_tokens + len(draft)) - len(seq.block_table)
                if need > self.bm.num_free_blocks - (len(self.running) - i - 1):
                    draft = []
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            self.bm.append_slots(seq, len(draft))
            n = min(n, budget)
            out.append(ScheduledChunk(seq, seq.num_computed_tokens, n, list(draft)))
            budget -= n + len(draft)
            i += 1

        # 2. Waiting sequences, first come first served.
        if not preempted:
            for seq in list(self.waiting):
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                if self.running and len(self.running) + 1 + len(seq.forks) > self.max_num_seqs:
                    break  # an n > 1 request runs its n choices at once once it is done prefilling
                try:
                    plan = self.bm.plan(seq, use_cache=seq.use_prefix_cache)
                except PrefixPending:
                    continue  # its prefix is being computed this very step: next step it hits
                # a request that will fork needs a copied last block and room to grow per choice
                grow = 1 + len(seq.forks)
                reserve = max(
                    self.watermark_blocks,
                    self.headroom_blocks_per_seq * (len(self.running) + grow) + grow - 1,
                )
                if plan.blocks_needed + reserve > self.bm.num_free_blocks and self.running:
                    break
                if plan.blocks_needed > self.bm.num_free_blocks:
                    break
                remaining = seq.num_tokens - len(plan.hits) * self.bm.block_size
                if not self.enable_chunked_prefill and remaining > budget and out:
                    break  # without chunking a prompt goes whole, alone if it must
                self.waiting.remove(seq)
                self.bm.allocate(seq, plan)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.perf_counter()
                    seq.prompt_cached_tokens = seq.num_cached_tokens
                self.stats.cached_tokens += seq.num_cached_tokens
                n = remaining if not self.enable_chunked_prefill else min(remaining, budget)
                out.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
        if out:
            self.stats.steps += 1
        return out

    def postprocess(
        self,
        chunks: Iterable[ScheduledChunk],
        next_tokens: dict[int, int],
        accepted: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Record a finished forward pass: advance each sequence, append sampled tokens.

        ``next_tokens`` maps ``seq_id`` to the token sampled for every chunk that ``samples``;
        ``accepted`` to the proposed tokens (speculative decoding) kept before it. Refused
        proposals' slots are dropped and their blocks returned.
        Returns the sequences that received a token (finished ones included).
        """
        touched: list[Sequence] = []
        for c in chunks:
            seq = c.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            is_decode = (
                c.length == 1 and seq.num_output_tokens > 0 and c.start == seq.num_tokens - 1
            )
            if is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += c.length
            seq.num_computed_tokens = c.start + c.length
            self.bm.mark_computed(seq)
            if not c.samples:
                continue
            touched.append(seq)
            if reason := prompt_only(seq):  # a prompt scored, nothing generated
                self.finish(seq, reason)
                continue
            kept = (accepted or {}).get(seq.seq_id, []) if c.draft else []
            self.stats.spec_proposed += len(c.draft)
            self.stats.spec_accepted += len(kept)
            for tok in kept:  # proposals the model agreed with: their keys/values are written
                self.append_token(seq, tok)
                if seq.is_finished:
                    break
                seq.num_computed_tokens += 1
                self.bm.mark_computed(seq)
                self.stats.decode_tokens += 1
            if not seq.is_finished:
                self.append_token(seq, next_tokens[seq.seq_id])
            if c.draft and not seq.is_finished:
                self.bm.trim(seq)  # the refused proposals' blocks go back
        return touched

    def append_token(self, seq: Sequence, tok: int) -> None:
        """Give a sequence its next token, and end it where :func:`llmlib.engine.stopping.take`
        says (an end token, a stop string, a finished grammar, a length limit)."""
        seq.token_ids.append(tok)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if reason := take(seq, tok, self.max_model_len):
            self.finish(seq, reason)

    def adopt(self, child: Sequence, parent: Sequence, running: bool) -> None:
        """Queue a choice forked from ``parent``: running (it holds the parent's blocks) or, when
        there was no block to copy into, first in line to be recomputed."""
        child.status = SequenceStatus.RUNNING if running else SequenceStatus.WAITING
        child.first_scheduled_time = parent.first_scheduled_time
        child.prompt_cached_tokens = parent.prompt_cached_tokens
        if running:
            self.running.append(child)
        else:
            self.waiting.appendleft(child)
