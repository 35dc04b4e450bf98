"""Attention over the paged cache equals attention over a contiguous cache (within 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmlib.engine.paged_cache import PagedKVCache, SeqChunk

H, HKV, D, BS = 4, 2, 8, 4


def attend(q, k, v, mask):
    """Plain attention with GQA by repeating kv heads; mask True = may attend."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def contiguous(q, k, v):
    """Reference: one sequence, its whole causal history in one tensor. q [1,H,T,D] for the last T positions."""
    T, S = q.shape[2], k.shape[2]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return attend(q, k, v, mask)


def test_paged_equals_contiguous_for_packed_prefill_then_batched_decode():
    torch.manual_seed(0)
    lengths = [5, 11, 1, 8]
    decode_steps = 6
    n_layers = 2
    total = sum(-(-(n + decode_steps) // BS) for n in lengths)
    cache = PagedKVCache(n_layers, total + 3, HKV, BS, D)
    # Scatter block ids so tables are neither contiguous nor sorted.
    perm = torch.randperm(total + 3).tolist()
    tables, p = [], 0
    for n in lengths:
        nb = -(-(n + decode_steps) // BS)
        tables.append(perm[p : p + nb])
        p += nb
    L = [n + decode_steps for n in lengths]
    K = [[torch.randn(1, HKV, n, D) for n in L] for _ in range(n_layers)]
    V = [[torch.randn(1, HKV, n, D) for n in L] for _ in range(n_layers)]
    Q = [torch.randn(1, H, n, D) for n in L]

    # Prefill: all prompts packed into ONE row, block-diagonal mask.
    step = cache.step([[SeqChunk(tables[i], 0, n) for i, n in enumerate(lengths)]])
    for layer in range(n_layers):
        k_new = torch.cat([K[layer][i][:, :, :n] for i, n in enumerate(lengths)], dim=2)
        v_new = torch.cat([V[layer][i][:, :, :n] for i, n in enumerate(lengths)], dim=2)
        q_new = torch.cat([Q[i][:, :, :n] for i, n in enumerate(lengths)], dim=2)
        k_all, v_all, mask = step.update(layer, k_new, v_new, step.positions)
        out = attend(q_new, k_all, v_all, mask)
        sdpa = F.scaled_dot_product_attention(q_new, k_all, v_all, attn_mask=mask, enable_gqa=True)
        t0 = 0
        for i, n in enumerate(lengths):
            ref = contiguous(Q[i][:, :, :n], K[layer][i][:, :, :n], V[layer][i][:, :, :n])
            torch.testing.assert_close(out[:, :, t0 : t0 + n], ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(sdpa[:, :, t0 : t0 + n], ref, atol=1e-5, rtol=0)
            t0 += n

    # Decode: one sequence per row, one new token each, different history lengths.
    for s in range(decode_steps):
        step = cache.step([[SeqChunk(tables[i], n + s, 1)] for i, n in enumerate(lengths)])
        for layer in range(n_layers):
            k_new = torch.cat([K[layer][i][:, :, n + s : n + s + 1] for i, n in enumerate(lengths)])
            v_new = torch.cat([V[layer][i][:, :, n + s : n + s + 1] for i, n in enumerate(lengths)])
            q_new = torch.cat([Q[i][:, :, n + s : n + s + 1] for i, n in enumerate(lengths)])
            k_all, v_all, mask = step.update(layer, k_new, v_new, step.positions)
            assert mask.shape == (len(lengths), 1, 1, k_all.shape[2])
            out = F.scaled_dot_product_attention(
                q_new, k_all, v_all, attn_mask=mask, enable_gqa=True
            )
            for i, n in enumerate(lengths):
                m = n + s + 1
                ref = contiguous(
                    Q[i][:, :, m - 1 : m], K[layer][i][:, :, :m], V[layer][i][:, :, :m]
                )
                torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=0)

    # The pool holds exactly each sequence's keys, in block-table order.
    for i, n in enumerate(L):
        flat = cache.k[1][tables[i]].reshape(-1, HKV, D)[:n].transpose(0, 1)  # token-major pool
        torch.testing.assert_close(flat, K[1][i][0], atol=0, rtol=0)


def test_chunked_prefill_over_cached_prefix():
    """A chunk that starts mid-sequence attends to the earlier tokens already in the pool."""
    torch.manual_seed(1)
    cache = PagedKVCache(1, 8, HKV, BS, D)
    table = [6, 2, 5, 0]
    n = 14
    k, v, q = torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D), torch.randn(1, H, n, D)
    for start, length in [(0, 8), (8, 5), (13, 1)]:
        step = cache.step([[SeqChunk(table, start, length)]])
        k_all, v_all, mask = step.update(
            0, k[:, :, start : start + length], v[:, :, start : start + length], step.positions
        )
        out = F.scaled_dot_product_attention(
            q[:, :, start : start + length], k_all, v_all, attn_mask=mask, enable_gqa=True
        )
        ref = contiguous(
            q[:, :, start : start + length], k[:, :, : start + length], v[:, :, : start + length]
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        assert step.positions.tolist() == [list(range(start, start + length))]


def test_padding_rows_do_not_produce_nan():
    cache = PagedKVCache(1, 4, HKV, BS, D)
    step = cache.step([[SeqChunk([0, 1], 0, 6)], [SeqChunk([2], 0, 2)]])  # row 1 is padded to T=6
    k, v, q = torch.randn(2, HKV, 6, D), torch.randn(2, HKV, 6, D), torch.randn(2, H, 6, D)
    k_all, v_all, mask = step.update(0, k, v, step.positions)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    assert torch.isfinite(out).all()
    # the padded tokens were not written anywhere
    assert (cache.k[0][3] == 0).all() and (cache.k[0][2][2:] == 0).all()


@pytest.mark.parametrize("backend", ["sdpa", "naive", "tiled"])
def test_attend_mixed_row_equals_contiguous(backend):
    """The engine's path: prefill chunks (one starting mid-sequence) and decode tokens of several
    sequences packed in ONE row; ``attend`` must give each token exactly its own sequence's
    causal attention, with every attention backend."""
    from llmlib.model.attention import AttentionSpec

    torch.manual_seed(2)
    fn = AttentionSpec(backend)
    cache = PagedKVCache(1, 40, HKV, BS, D)
    # (total length, tokens already in the pool before this step)
    seqs = [(9, 0), (13, 6), (7, 6), (17, 16), (5, 4)]  # two prefills (one chunked), three decodes
    perm = torch.randperm(40).tolist()
    tables, p = [], 0
    for n, _ in seqs:
        tables.append(perm[p : p + -(-n // BS)])
        p += -(-n // BS)
    K = [torch.randn(1, HKV, n, D) for n, _ in seqs]
    V = [torch.randn(1, HKV, n, D) for n, _ in seqs]
    Q = [torch.randn(1, H, n, D) for n, _ in seqs]
    # what earlier steps wrote: the first `done` tokens of each sequence
    for (n, done), t, k, v in zip(seqs, tables, K, V):
        if done:
            cache.step([[SeqChunk(t, 0, done)]]).update(0, k[:, :, :done], v[:, :, :done])
    step = cache.step([[SeqChunk(t, done, n - done) for (n, done), t in zip(seqs, tables)]])
    q = torch.cat([Q[i][:, :, done:] for i, (n, done) in enumerate(seqs)], 2)
    k = torch.cat([K[i][:, :, done:] for i, (n, done) in enumerate(seqs)], 2)
    v = torch.cat([V[i][:, :, done:] for i, (n, done) in enumerate(seqs)], 2)
    out = step.attend(0, q, k, v, fn)
    assert out.shape == q.shape
    t0 = 0
    for i, (n, done) in enumerate(seqs):
        ref = contiguous(Q[i][:, :, done:], K[i], V[i])
        torch.testing.assert_close(out[:, :, t0 : t0 + n - done], ref, atol=1e-5, rtol=0)
        t0 += n - done
    # and the contract path of the same step agrees with it
    k_all, v_all, mask = step.update(0, k, v)
    torch.testing.assert_close(attend(q, k_all, v_all, mask), out, atol=1e-5, rtol=0)


def test_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(1, 0, 1, 4, 8)
    cache = PagedKVCache(1, 4, HKV, BS, D)
    with pytest.raises(ValueError, match="cannot hold"):
        cache.step([[SeqChunk([0], 0, 5)]])
    assert cache.bytes_per_block == 2 * 1 * HKV * BS * D * 4


def test_decode_rows_grouped_by_length():
    """Single-token chunks are split into groups of similar length: each chunk in exactly one
    group, short ones never padded to the longest when a separate call is cheaper."""
    from llmlib.engine.paged_cache import DecodeToken, _group_by_length

    chunks = [DecodeToken(0, i, 0, [0] * n) for i, n in enumerate([40, 1, 2, 41, 1, 39, 2])]
    groups = _group_by_length(chunks, BS)
    assert sorted(c.col for g in groups for c in g) == list(range(7))
    assert [sorted(len(c.blocks) for c in g) for g in groups] == [[1, 1, 2, 2], [39, 40, 41]]
    same = [DecodeToken(0, 0, 0, [0] * 5)] * 3
    assert _group_by_length(same, BS) == [same]  # equal lengths: one call
    assert _group_by_length([], BS) == []
