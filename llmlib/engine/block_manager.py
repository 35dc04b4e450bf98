"""The block manager: hands out the paged KV cache in fixed-size blocks (chapter 10).

A static KV cache reserves ``max_len`` slots for every sequence up front, and most sit empty.
Here the cache is a pool of small blocks (``block_size`` token slots each, in every layer); a
sequence's *block table* lists the blocks holding its tokens, in order, and grows only when its
last block is full: at most ``block_size - 1`` slots per sequence sit unused {cite}`kwon2023`.

Prefix sharing. A full block is named by a hash of its tokens *and of the block before it* (a
chain): the same hash means the same tokens, positions and history. A new prompt starting with
blocks in the pool (a shared system prompt) points its table at them, bumps their reference
counts and skips computing them. Freed blocks keep contents and hash until reused, so a finished
request's prefix can still serve.

The manager keeps books on integers only (tensors: :mod:`llmlib.engine.paged_cache`), for any
:class:`~llmlib.engine.sequence.SequenceView`, such as :class:`~llmlib.engine.sequence.Sequence`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from llmlib.engine.sequence import SequenceView


def block_hash(parent: int | None, tokens: Seq[int]) -> int:
    """Hash of one full block, chained to its parent's: equal hashes mean equal *prefixes*.
    A tuple of ints hashes the same in every run (only str/bytes hashing is salted)."""
    return hash((-1 if parent is None else parent, tuple(tokens)))


@dataclass
class Block:
    """One block of ``block_size`` KV slots (the same block id in every layer's pool)."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full (its tokens are then fixed)
    token_ids: tuple[int, ...] = ()  # the tokens of a hashed block, to rule out hash collisions
    computed: bool = False  # its keys/values have been written (a hit on it may skip compute)

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.token_ids = ()
        self.computed = False


class PrefixPending(Exception):
    """The sequence's prefix is being computed right now by another sequence; wait a step."""


@dataclass
class AllocationPlan:
    """What :meth:`BlockManager.allocate` would do for a sequence, computed without side effects."""

    hits: list[int] = field(default_factory=list)  # block ids reused from the prefix cache
    hashes: list[int | None] = field(default_factory=list)  # hash of every block of the sequence
    num_new: int = 0  # fresh blocks to take from the free list
    num_revived: int = 0  # cached blocks that are currently free (they leave the free list too)

    @property
    def blocks_needed(self) -> int:
        return self.num_new + self.num_revived


class BlockManager:
    """Free list, reference counts, block tables and the prefix-cache index of a block pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        outputs_apart: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: name a block holding generated tokens apart from the same tokens given as a prompt
        #: (the compiled batch-invariant engine computes the two kinds in groups of two sizes)
        self.outputs_apart = outputs_apart
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free list is ordered oldest-freed first: we hand out the oldest block, so a block
        # freed recently (likely a prefix someone will ask for again) keeps its contents longest.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # counters for the book and the benchmarks
        self.num_prefix_hit_blocks = 0
        self.num_prefix_queries = 0

    # ---- inspection -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------
    def _take_free(self, block_id: int | None = None) -> Block:
        """Take a block off the free list: a given (cached) one, or the oldest free one."""
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            # Its old contents are about to be overwritten: forget them in the prefix index.
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.reset()
        else:
            del self.free[block_id]
            block = self.blocks[block_id]
        block.ref_count = 1
        return block

    def _hash(self, seq: SequenceView, i: int, parent: int | None, chunk: Seq[int]) -> int:
        """The chain hash of ``seq``'s full block ``i``; with :attr:`outputs_apart`, a block
        holding generated tokens also names where in it the prompt ends."""
        h = block_hash(parent, chunk)
        if self.outputs_apart:
            in_prompt = seq.num_prompt_tokens - i * self.block_size
            if in_prompt < self.block_size:
                h = hash((h, "generated", max(in_prompt, 0)))
        return h

    def plan(self, seq: SequenceView, use_cache: bool = True) -> AllocationPlan:
        """How many blocks admitting ``seq`` takes, and which prefix blocks it reuses. Raises
        :class:`PrefixPending` when a block it could share is being prefilled this step: waiting
        a step makes it a hit, so a shared prefix is computed once. ``use_cache=False`` computes
        every token (for every prompt position's logits)."""
        tokens = seq.token_ids
        bs = self.block_size
        n_blocks = self.blocks_for(len(tokens))
        plan = AllocationPlan()
        parent: int | None = None
        hitting = self.enable_prefix_caching and use_cache
        for i in range(n_blocks):
            chunk = tokens[i * bs : (i + 1) * bs]
            h = self._hash(seq, i, parent, chunk) if len(chunk) == bs else None
            plan.hashes.append(h)
            parent = h
            # the last token is always computed: its logits sample the next token
            if hitting and h is not None and (i + 1) * bs <= len(tokens) - 1:
                bid = self.hash_to_block.get(h)
                if bid is not None and self.blocks[bid].token_ids == tuple(chunk):
                    if not self.blocks[bid].computed:
                        raise PrefixPending(f"block {bid} is being computed by another sequence")
                    plan.hits.append(bid)
                    if self.blocks[bid].ref_count == 0:
                        plan.num_revived += 1
                    continue
            hitting = False  # a chain: after the first miss nothing further can hit
            plan.num_new += 1
        return plan

    def allocate(self, seq: SequenceView, plan: AllocationPlan | None = None) -> None:
        """Give ``seq`` a block table, reusing cached prefix blocks; set its cached and computed
        token counts."""
        if seq.block_table:
            raise ValueError("allocate: the sequence already has a block table")
        plan = plan if plan is not None else self.plan(seq)
        if plan.blocks_needed > len(self.free):
            raise RuntimeError(f"allocate: need {plan.blocks_needed} blocks, {len(self.free)} free")
        bs = self.block_size
        table: list[int] = []
        self.num_prefix_queries += len(plan.hashes)
        for i, h in enumerate(plan.hashes):
            if i < len(plan.hits):
                bid = plan.hits[i]
                block = self.blocks[bid]
                if block.ref_count == 0:
                    self._take_free(bid)
                else:
                    block.ref_count += 1
                self.num_prefix_hit_blocks += 1
            else:
                block = self._take_free()
                if h is not None and self.enable_prefix_caching:
                    # a full prompt block: indexed now, "pending" until its pass writes it
                    block.hash = h
                    block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    self.hash_to_block.setdefault(h, block.block_id)
                bid = block.block_id
            table.append(bid)
        seq.block_table = table
        seq.num_cached_tokens = len(plan.hits) * bs
        seq.num_computed_tokens = seq.num_cached_tokens

    def fork(self, parent: SequenceView, child: SequenceView) -> list[tuple[int, int]] | None:
        """Give ``child`` the parent's KV blocks (``n > 1``), sharing full ones and copying a
        partly filled last one, which each choice writes on. Returns the ``(source,
        destination)`` copies the cache must make, or None (nothing changed) if no block is free."""
        if child.block_table:
            raise ValueError("fork: the child already has a block table")
        bs = self.block_size
        n = parent.num_computed_tokens
        partial = n % bs != 0
        if partial and not self.free:
            return None
        table = list(parent.block_table[: -(-n // bs)])
        copies = []
        for bid in table[:-1] if partial else table:
            self.blocks[bid].ref_count += 1
        if partial:
            fresh = self._take_free()
            copies.append((table[-1], fresh.block_id))
            table[-1] = fresh.block_id
        child.block_table = table
        child.num_computed_tokens = n
        child.num_cached_tokens = parent.num_cached_tokens
        return copies

    def can_append(self, seq: SequenceView, lookahead: int = 0) -> bool:
        """Is there room for the sequence's tokens (and ``lookahead`` proposed ones after them)?"""
        missing = self.blocks_for(len(seq.token_ids) + lookahead) - len(seq.block_table)
        return missing <= len(self.free)

    def append_slots(self, seq: SequenceView, lookahead: int = 0) -> None:
        """Grow the block table to cover every token, and ``lookahead`` (speculative) slots more."""
        while len(seq.block_table) * self.block_size < len(seq.token_ids) + lookahead:
            if not self.free:
                raise RuntimeError(
                    "append_slots: no free block (the scheduler should have preempted)"
                )
            seq.block_table.append(self._take_free().block_id)

    def mark_computed(self, seq: SequenceView) -> None:
        """After a pass: flag blocks now fully written, and hash newly full ones for reuse."""
        bs = self.block_size
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        first = n_full  # the computed blocks are a prefix of the table: walk back to its end
        while first and not self.blocks[seq.block_table[first - 1]].computed:
            first -= 1
        for i in range(first, n_full):
            block = self.blocks[seq.block_table[i]]
            if block.computed:
                continue
            block.computed = True
            if block.hash is None and self.enable_prefix_caching:
                parent = self.blocks[seq.block_table[i - 1]].hash if i else None
                if i and parent is None:
                    continue  # parent unhashed (prefix caching turned on midway): no chain
                chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.hash = self._hash(seq, i, parent, chunk)
                block.token_ids = chunk
                self.hash_to_block.setdefault(block.hash, block.block_id)

    def trim(self, seq: SequenceView) -> int:
        """Free the blocks past the tokens (refused drafts held them, never computed); how many."""
        keep = max(self.blocks_for(len(seq.token_ids)), 0)
        extra = seq.block_table[keep:]
        for bid in reversed(extra):
            block = self.blocks[bid]
            if block.ref_count != 1 or block.computed:
                raise RuntimeError(f"trim: block {bid} is shared or computed")
            block.ref_count = 0
            block.reset()
            self.free[bid] = None
        del seq.block_table[keep:]
        return len(extra)

    def free_seq(self, seq: SequenceView) -> None:
        """Drop a reference to each of a sequence's blocks (finished, aborted or preempted). At
        zero a block is freed *with its contents*, still indexed, unless it was never computed."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise RuntimeError(f"free_seq: block {bid} is already free (double free)")
            block.ref_count -= 1
            if block.ref_count == 0:
                if not block.computed:
                    if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
                        del self.hash_to_block[block.hash]
                    block.reset()
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    # ---- accounting -------------------------------------------------------------------------
    def usage(self, seqs: Seq[SequenceView]) -> tuple[int, int]:
        """(slots allocated, slots holding a token) over these sequences' blocks, shared ones
        counted once. The difference, unused memory, is only each sequence's last block's tail."""
        bs = self.block_size
        full: set[int] = set()  # blocks some sequence fills (a set: in C, every step)
        tail: dict[int, int] = {}  # the others: a last block, or ones held ahead of the tokens
        for seq in seqs:
            bt, n = seq.block_table, len(seq.token_ids)
            k = min(len(bt), n // bs)
            full.update(bt[:k])
            for i in range(k, len(bt)):
                tail[bt[i]] = max(tail.get(bt[i], 0), max(0, n - i * bs))
        partial = {b: f for b, f in tail.items() if b not in full}
        return (len(full) + len(partial)) * bs, len(full) * bs + sum(partial.values())

    def check_consistency(self, seqs: Seq[SequenceView] = ()) -> None:
        """Assert the invariants (used by the tests): counts match the live block tables."""
        counts = [0] * self.num_blocks
        for seq in seqs:
            for bid in seq.block_table:
                counts[bid] += 1
        for block, c in zip(self.blocks, counts):
            assert block.ref_count == c, (
                f"block {block.block_id}: ref_count {block.ref_count} != {c} users"
            )
            assert (block.block_id in self.free) == (c == 0), (
                f"block {block.block_id}: free list disagrees"
            )
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, (
                f"prefix index points at block {bid} with another hash"
            )
