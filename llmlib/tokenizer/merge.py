"""The two merge loops: byte-pair merges by rank, SentencePiece merges by score.

Both start from a row of symbols and join one adjacent pair at a time:

- **BPE** (GPT-2, Llama 3, Qwen, Gemma 4, ...) joins the pair whose merge has the *lowest rank*,
  the leftmost such pair first, until no adjacent pair is in the merge table;
- **SentencePiece** (Llama 2, Phi-3) joins the pair whose concatenation is a token with the
  *highest score*, the leftmost such pair first, until no adjacent pair makes a token.

A row of a few symbols (a word after pre-tokenization) is cheapest rescanned at every step. A
long row (SentencePiece sees a whole text at once; Gemma 4 a whole line) keeps its candidate
pairs in a heap instead: each merge pushes the at most two new pairs it creates, and an entry
made stale by an earlier merge is recognised when it is popped and skipped, so a row of n
symbols costs O(n log n) rather than O(n^2).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from heapq import heapify, heappop, heappush


def merge_table(
    lefts: Sequence[str], rights: Sequence[str], text_id: dict[str, int], where: str = "merges"
) -> tuple[list[tuple[int, int]], dict[tuple[int, int], tuple[int, int]]]:
    """A merge list given as texts (``lefts[k] + rights[k]``, rank k) -> the id pairs, and the
    table ``(left, right) -> (rank, merged id)`` (the first rank where a pair is listed twice)."""
    get = text_id.get
    ia = list(map(get, lefts))
    ib = list(map(get, rights))
    im = list(map(get, map(operator.add, lefts, rights)))
    if None in ia or None in ib or None in im:
        k = next(k for k in range(len(ia)) if None in (ia[k], ib[k], im[k]))
        raise ValueError(
            f"{where}: merges[{k}] = {lefts[k]!r} + {rights[k]!r} does not join two tokens into one"
        )
    merges = list(zip(ia, ib))
    # built from the end, so that the first rank of a pair listed twice is the one kept
    ranks = dict(zip(reversed(merges), zip(range(len(merges) - 1, -1, -1), reversed(im))))
    return merges, ranks  # type: ignore[return-value]


# Below this many symbols the rescanning loop beats the heap's bookkeeping.
_SHORT = 24


def bpe_merge(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Merge ``ids`` by rank: ``ranks[(left, right)] = (rank, merged id)``.

    The lowest rank goes first and, between equal ranks, the leftmost pair. Ids that are in no
    pair of the table (negative placeholders, say) simply never merge.
    """
    if len(ids) < 2:
        return list(ids)
    if len(ids) <= _SHORT:
        return _bpe_rescan(list(ids), ranks)
    return _bpe_heap(ids, ranks)


def _bpe_rescan(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    get = ranks.get
    while len(ids) > 1:
        best_rank, best_i, best_id = None, -1, -1
        for i in range(len(ids) - 1):
            hit = get((ids[i], ids[i + 1]))
            if hit is not None and (best_rank is None or hit[0] < best_rank):
                best_rank, best_i, best_id = hit[0], i, hit[1]
        if best_rank is None:
            break
        ids[best_i : best_i + 2] = [best_id]
    return ids


def _bpe_heap(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    get = ranks.get
    n = len(ids)
    sym = list(ids)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    alive = [True] * n
    # (rank, position of the left symbol, left id, right id, merged id); positions only grow
    # left to right, so equal ranks pop leftmost first
    heap = []
    for i in range(n - 1):
        hit = get((sym[i], sym[i + 1]))
        if hit is not None:
            heap.append((hit[0], i, sym[i], sym[i + 1], hit[1]))
    heapify(heap)
    while heap:
        _, i, a, b, merged = heappop(heap)
        j = nxt[i]
        # stale: the left symbol was swallowed, or either side has changed since the push
        if not alive[i] or j < 0 or sym[i] != a or sym[j] != b:
            continue
        sym[i] = merged
        alive[j] = False
        k = nxt[j]
        nxt[i] = k
        if k >= 0:
            prv[k] = i
            hit = get((merged, sym[k]))
            if hit is not None:
                heappush(heap, (hit[0], i, merged, sym[k], hit[1]))
        p = prv[i]
        if p >= 0:
            hit = get((sym[p], merged))
            if hit is not None:
                heappush(heap, (hit[0], p, sym[p], merged, hit[1]))
    out = []
    i = 0
    while i >= 0:
        out.append(sym[i])
        i = nxt[i]
    return out


def spm_merge(text: str, token_id: dict[str, int], scores: list[float]) -> list[str]:
    """SentencePiece's merge over the characters of ``text``; returns the final pieces.

    Any two adjacent pieces whose concatenation is a token (``token_id``) may merge; the token
    with the highest ``scores[id]`` goes first, the leftmost between equal scores. A piece left
    at the end that is not a token (a character the vocabulary lacks) is for the caller to
    spell in byte tokens.
    """
    n = len(text)
    if n < 2:
        return [text] if text else []
    get = token_id.get
    # piece i covers text[start[i]:end[i]]; a merge grows the left piece over the right one
    start = list(range(n))
    end = list(range(1, n + 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        t = get(text[i : i + 2])
        if t is not None:
            heap.append((-scores[t], i, i + 1, 2))
    heapify(heap)
    while heap:
        _, left, right, size = heappop(heap)
        # stale: a side was swallowed, or the right piece grew since the push (a piece's start
        # never moves and it grows only by swallowing its right neighbour)
        if not alive[left] or not alive[right] or end[right] - start[left] != size:
            continue
        end[left] = end[right]
        alive[right] = False
        k = nxt[right]
        nxt[left] = k
        if k >= 0:
            prv[k] = left
            t = get(text[start[left] : end[k]])
            if t is not None:
                heappush(heap, (-scores[t], left, k, end[k] - start[left]))
        p = prv[left]
        if p >= 0:
            t = get(text[start[p] : end[left]])
            if t is not None:
                heappush(heap, (-scores[t], p, left, end[left] - start[p]))
    out = []
    i = 0
    while i >= 0:
        out.append(text[start[i] : end[i]])
        i = nxt[i]
    return out
