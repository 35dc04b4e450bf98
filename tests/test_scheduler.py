"""The scheduler on fake sequences (no model): budget, mixing, preemption, finishing, prefix reuse."""

from __future__ import annotations

import pytest

from llmlib.engine.block_manager import BlockManager
from llmlib.engine.scheduler import Scheduler, Sequence, SequenceStatus

_ids = iter(range(10**6))


def seq(n_prompt: int, max_tokens: int = 8, first: int = 0, eos=(), **kw) -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        prompt_token_ids=[first + i for i in range(n_prompt)],
        max_tokens=max_tokens,
        eos_token_ids=frozenset(eos),
        **kw,
    )


def run_step(s: Scheduler, token: int = 7):
    """schedule + pretend the model ran: every chunk that reaches its end samples ``token``."""
    chunks = s.schedule()
    nxt = {c.seq.seq_id: token for c in chunks if c.samples}
    s.postprocess(chunks, nxt)
    return chunks


def drain(s: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while s.has_unfinished():
        run_step(s)
        s.bm.check_consistency(s.running)
        steps += 1
        assert steps < limit
    return steps


def test_token_budget_and_chunked_prefill():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a, b = seq(30), seq(5, first=100)
    s.add(a)
    s.add(b)
    chunks = run_step(s)
    assert [(c.seq, c.start, c.length) for c in chunks] == [(a, 0, 16)]  # a takes the whole budget
    assert a.num_computed_tokens == 16 and a.num_output_tokens == 0
    chunks = run_step(s)
    assert [(c.seq, c.start, c.length) for c in chunks] == [(a, 16, 14), (b, 0, 2)]
    assert a.num_output_tokens == 1  # a's prompt is done: it sampled its first token
    chunks = run_step(s)
    # a decodes one token; b continues its prompt; all within the budget
    assert [(c.seq, c.start, c.length) for c in chunks] == [(a, 30, 1), (b, 2, 3)]
    assert sum(c.length for c in chunks) <= 16
    drain(s)
    assert s.bm.num_free_blocks == 64


def test_decode_and_prefill_share_a_step():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq(6)
    s.add(a)
    run_step(s)
    b = seq(9, first=100)
    s.add(b)
    chunks = run_step(s)
    assert [(c.seq, c.length) for c in chunks] == [(a, 1), (b, 9)]


def test_max_num_seqs_caps_the_batch():
    s = Scheduler(BlockManager(256, 4), max_num_seqs=3, max_num_batched_tokens=1000)
    seqs = [seq(5, max_tokens=4) for _ in range(7)]
    for q in seqs:
        s.add(q)
    while s.has_unfinished():
        run_step(s)
        assert len(s.running) <= 3
    assert all(q.finish_reason == "length" and q.num_output_tokens == 4 for q in seqs)


def test_finish_on_eos_and_max_tokens_frees_blocks():
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_num_batched_tokens=100)
    a = seq(5, max_tokens=100, eos=[7])  # run_step samples 7: the EOS
    b = seq(5, max_tokens=3, eos=[2])
    c = seq(5, max_tokens=3, eos=[7], ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    drain(s)
    assert (a.finish_reason, a.output_token_ids) == ("stop", [7])
    assert (b.finish_reason, b.num_output_tokens) == ("length", 3)
    assert (c.finish_reason, c.num_output_tokens) == ("length", 3)
    assert bm.num_free_blocks == 32 and all(q.block_table == [] for q in (a, b, c))


def test_preemption_requeues_the_newest_and_everything_finishes():
    # 24 slots: not enough for three 13-token sequences
    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0)
    a, b, c = (
        seq(4, max_tokens=9, first=0),
        seq(4, max_tokens=9, first=100),
        seq(4, max_tokens=9, first=200),
    )
    for q in (a, b, c):
        s.add(q)
    run_step(s)  # all three admitted: 3 blocks used
    assert s.running == [a, b, c]
    seen_preempt = False
    while s.has_unfinished():
        before = list(s.running)
        run_step(s)
        bm.check_consistency(s.running)
        if s.stats.preemptions and not seen_preempt:
            seen_preempt = True
            victim = [q for q in before if q.status is SequenceStatus.WAITING]
            assert victim == [before[-1]]  # the newest running sequence is the one preempted
            assert s.waiting[0] is victim[0]  # ... and it is first in line to come back
            assert victim[0].block_table == [] and victim[0].num_computed_tokens == 0
            assert victim[0].num_output_tokens > 0  # its tokens are kept for recompute
    assert seen_preempt and s.stats.preemptions >= 1
    assert all(q.num_output_tokens == 9 for q in (a, b, c))
    assert bm.num_free_blocks == 6


def test_request_too_long_for_the_pool_is_refused():
    s = Scheduler(BlockManager(4, 4))
    with pytest.raises(ValueError, match="exceeds"):
        s.add(seq(10, max_tokens=10))


def test_abort_waiting_and_running():
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=1)
    a, b = seq(5), seq(5)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert not s.has_unfinished() and bm.num_free_blocks == 16
    assert a.finish_reason == b.finish_reason == "abort"


def test_shared_prefix_is_computed_once_even_when_admitted_together():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_batched_tokens=1000)
    system = list(range(500, 516))  # 16 tokens = 4 blocks
    seqs = [
        Sequence(seq_id=next(_ids), prompt_token_ids=system + [i, i + 1], max_tokens=3)
        for i in range(5)
    ]
    for q in seqs:
        s.add(q)
    chunks = run_step(s)
    # only the first is admitted while the shared blocks are being computed ...
    assert [c.seq for c in chunks] == [seqs[0]]
    chunks = run_step(s)
    # ... then the others start after the shared prefix, computing only their own 2 tokens
    assert [(c.seq, c.start, c.length) for c in chunks[1:]] == [(q, 16, 2) for q in seqs[1:]]
    drain(s)
    assert s.stats.prefill_tokens == 18 + 4 * 2
    assert s.stats.cached_tokens == 4 * 16
    assert bm.num_free_blocks == 64


def test_admission_keeps_a_block_of_headroom_per_running_sequence():
    """A prompt that would leave fewer free blocks than running sequences waits (no watermark here)."""
    s4 = Scheduler(
        BlockManager(8, 4, enable_prefix_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        watermark=0.0,
        headroom_blocks_per_seq=1,
    )
    for first in (0, 100, 200, 300):
        s4.add(seq(8, max_tokens=4, first=first))
    run_step(s4)
    # 8 blocks: first (6 left), second (4 left >= 2), third would leave 2 < 3: it waits
    assert len(s4.running) == 2 and len(s4.waiting) == 2
    drain(s4)
    assert s4.stats.preemptions == 0 and s4.bm.num_free_blocks == 8
    s0 = Scheduler(
        BlockManager(8, 4, enable_prefix_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        watermark=0.0,
        headroom_blocks_per_seq=0,
    )
    for first in (0, 100, 200, 300):
        s0.add(seq(8, max_tokens=4, first=first))
    run_step(s0)
    assert len(s0.running) == 4  # no headroom: the pool is filled to the brim ...
    drain(s0)
    assert s0.stats.preemptions > 0  # ... and pays for it with preemptions
    with pytest.raises(ValueError, match="headroom"):
        Scheduler(BlockManager(8, 4), headroom_blocks_per_seq=-1)
