"""The block manager: free list, reference counts, block tables, and prefix sharing by chained hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmlib.engine.block_manager import BlockManager, PrefixPending, block_hash


@dataclass
class FakeSeq:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0


def compute_all(bm: BlockManager, seq: FakeSeq) -> None:
    """Pretend a forward pass wrote every token of the sequence."""
    seq.num_computed_tokens = len(seq.token_ids)
    bm.mark_computed(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = FakeSeq(list(range(9))), FakeSeq(list(range(100, 104)))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1  # ceil(9/4), ceil(4/4)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_free_blocks == 6
    bm.check_consistency([a, b])
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 10
    bm.check_consistency([])
    with pytest.raises(RuntimeError, match="double free"):
        b.block_table = [0]
        bm.free_seq(b)


def test_append_takes_a_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = FakeSeq([1, 2, 3])
    bm.allocate(s)
    for t in range(4, 13):
        s.token_ids.append(t)
        assert bm.can_append(s)
        bm.append_slots(s)
        assert len(s.block_table) == -(-len(s.token_ids) // 4)
    assert len(s.token_ids) == 12 and len(s.block_table) == 3
    # usage: 3 blocks allocated, 12 slots filled, no waste
    assert bm.usage([s]) == (12, 12)
    s.token_ids.append(13)
    bm.append_slots(s)
    assert bm.usage([s]) == (16, 13)
    s.token_ids += [14, 15, 16, 17]
    assert not bm.can_append(s)  # would need a 5th block of 4
    with pytest.raises(RuntimeError):
        bm.append_slots(s)


def test_shared_prefix_reuses_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(50, 62))  # 12 tokens = 3 full blocks
    a = FakeSeq(system + [1, 2, 3])
    bm.allocate(a)
    assert a.num_cached_tokens == 0
    # While a's prefix is still being computed, b must wait rather than compute it again.
    b = FakeSeq(system + [7, 8])
    with pytest.raises(PrefixPending):
        bm.plan(b)
    compute_all(bm, a)
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    for bid in a.block_table[:3]:
        assert bm.blocks[bid].ref_count == 2
    bm.check_consistency([a, b])
    # A different first block breaks the chain even if later blocks are equal.
    c = FakeSeq([0] + system[1:] + [9])
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    bm.free_seq(a)
    bm.free_seq(b)
    bm.free_seq(c)
    assert bm.num_free_blocks == 16
    bm.check_consistency([])


def test_prefix_survives_its_owner_until_the_block_is_reused():
    bm = BlockManager(num_blocks=6, block_size=4)
    prefix = list(range(8))
    a = FakeSeq(prefix + [100])
    bm.allocate(a)
    compute_all(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 6
    b = FakeSeq(prefix + [200, 201])
    plan = bm.plan(b)
    assert len(plan.hits) == 2 and plan.num_revived == 2 and plan.num_new == 1
    bm.allocate(b, plan)
    assert b.num_cached_tokens == 8
    bm.free_seq(b)
    # Fill the pool with other tokens: the cached prefix gets overwritten and forgotten.
    big = FakeSeq(list(range(1000, 1024)))
    bm.allocate(big)
    compute_all(bm, big)
    bm.free_seq(big)
    d = FakeSeq(prefix + [5])
    assert bm.plan(d).hits == []
    bm.check_consistency([])


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = FakeSeq(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    b = FakeSeq(list(range(8)))  # identical prompt, exactly 2 full blocks
    bm.allocate(b)
    # Only the first block may hit: the last token's logits must be computed to sample.
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_decode_filled_blocks_are_indexed_with_the_chain_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = FakeSeq([1, 2, 3])
    bm.allocate(s)
    for t in [4, 5, 6]:
        s.token_ids.append(t)
        bm.append_slots(s)
        compute_all(bm, s)
    h0 = block_hash(None, [1, 2, 3, 4])
    assert bm.blocks[s.block_table[0]].hash == h0
    assert bm.hash_to_block[h0] == s.block_table[0]
    assert bm.blocks[s.block_table[1]].hash is None  # 2 tokens in it: not full yet


@pytest.mark.parametrize("apart", [False, True])
def test_blocks_of_generated_tokens_can_be_named_apart(apart):
    """``outputs_apart`` (the compiled batch-invariant engine, which computes a prompt's tokens
    and generated ones in groups of two sizes): a next turn whose prompt holds the first turn's
    answer hits only the blocks that were prompt in both; the first turn's own recompute (a
    preemption) still hits its mixed block, named the same way both times."""
    bm = BlockManager(num_blocks=16, block_size=4, outputs_apart=apart)
    first = FakeSeq(list(range(6)), num_prompt_tokens=6)
    bm.allocate(first)
    for t in range(6, 13):  # an answer of 7 tokens: block 1 mixed, block 2 all generated
        first.token_ids.append(t)
        bm.append_slots(first)
        compute_all(bm, first)
    turn = FakeSeq(list(range(14)), num_prompt_tokens=14)
    assert len(bm.plan(turn).hits) == (1 if apart else 3)
    again = FakeSeq(list(range(13)), num_prompt_tokens=6)  # the first turn, recomputed
    assert len(bm.plan(again).hits) == 3


def test_uncomputed_blocks_are_unindexed_when_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = FakeSeq(list(range(9)))
    bm.allocate(a)
    bm.free_seq(a)  # preempted/aborted before its prefill ran
    assert bm.hash_to_block == {}
    b = FakeSeq(list(range(9)))
    bm.plan(b)  # must not raise PrefixPending forever


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, -1)


def test_prefix_caching_can_be_turned_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = FakeSeq(list(range(9)))
    bm.allocate(a)
    compute_all(bm, a)
    b = FakeSeq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)
