"""Naive, SDPA and tiled attention agree (MHA and GQA of several ratios, causal and masked, square and
decode-shaped), and the naive reference behaves like the textbook formula."""

from __future__ import annotations

import math

import pytest
import torch

from llmlib.model.attention import causal_mask, naive_attention, sdpa_attention, tiled_attention

TOL = 1e-5


def _qkv(B: int, H: int, Hkv: int, T: int, S: int, hd: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    k = torch.randn(B, Hkv, S, hd, generator=g)
    v = torch.randn(B, Hkv, S, hd, generator=g)
    return q, k, v


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("T,S", [(1, 1), (37, 37), (130, 130), (1, 70), (5, 70)])
def test_three_implementations_agree_causal(H: int, Hkv: int, T: int, S: int) -> None:
    q, k, v = _qkv(2, H, Hkv, T, S)
    ref = naive_attention(q, k, v)
    torch.testing.assert_close(sdpa_attention(q, k, v), ref, atol=TOL, rtol=0)
    # tiles smaller than the sequence, and not dividing it, so tile edges and skipped tiles are exercised
    torch.testing.assert_close(
        tiled_attention(q, k, v, block_q=16, block_k=24), ref, atol=TOL, rtol=0
    )
    torch.testing.assert_close(tiled_attention(q, k, v), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 1)])
def test_three_implementations_agree_with_mask(H: int, Hkv: int) -> None:
    B, T, S = 3, 6, 50
    q, k, v = _qkv(B, H, Hkv, T, S, seed=1)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.5
    mask[..., 0] = True  # every query sees at least one key
    ref = naive_attention(q, k, v, mask)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), ref, atol=TOL, rtol=0)
    torch.testing.assert_close(
        tiled_attention(q, k, v, mask, block_q=4, block_k=16), ref, atol=TOL, rtol=0
    )


def test_naive_matches_the_formula() -> None:
    q, k, v = _qkv(1, 2, 2, 5, 5, hd=8)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores + torch.triu(torch.full((5, 5), float("-inf")), diagonal=1)
    expect = torch.softmax(scores, dim=-1) @ v
    out, probs = naive_attention(q, k, v, return_probs=True)
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 5))
    assert (probs[..., ~causal_mask(5, 5)] == 0).all()  # nothing above the diagonal


def test_gqa_equals_repeated_heads() -> None:
    q, k, v = _qkv(1, 6, 2, 9, 9)
    expanded = naive_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(
        tiled_attention(q, k, v, block_q=4, block_k=4), expanded, atol=TOL, rtol=0
    )
    # query head 0..2 share KV head 0: changing KV head 1 must leave them untouched
    # (random noise, not a constant: a constant added to every key of a head shifts each query's
    # scores equally, which the softmax cancels)
    k2 = k.clone()
    k2[:, 1] += torch.randn(k2[:, 1].shape, generator=torch.Generator().manual_seed(5))
    a, b = sdpa_attention(q, k, v), sdpa_attention(q, k2, v)
    assert torch.equal(a[:, :3], b[:, :3]) and not torch.allclose(a[:, 3:], b[:, 3:])


def test_causal_mask_aligns_to_the_end() -> None:
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_bad_shapes() -> None:
    q, k, v = _qkv(1, 5, 2, 3, 3)
    with pytest.raises(ValueError, match="multiple"):
        naive_attention(q, k, v)
    with pytest.raises(ValueError, match="expected q"):
        tiled_attention(q[0], k, v)
