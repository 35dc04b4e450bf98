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

from collections.abc import Sequence
from heapq import heapify, heappop, heappush


class MergeRanks:
    """A GGUF merge list (``"left right"`` strings in rank order) as the table ``(left id,
    right id) -> (rank, merged id)``, filled in only for the pairs that text actually meets.

    Building the whole table of a 262,144-token vocabulary with 514,906 merges (Gemma 4) takes
    seconds; one dictionary from merge string to rank takes a fraction of one, and a pair is
    looked up as ``texts[left] + " " + texts[right]``. That is exact when every merge string has
    one space, not at the start (no token in the list holds a space), as in every byte-level
    vocabulary; otherwise the table is built whole, splitting each merge at its first space
    after the first character, as llama.cpp does. A merge whose pieces or result are not tokens
    never applies.
    """

    def __init__(self, merges: Sequence[str], texts: Sequence[str], text_id: dict[str, int]):
        self._texts, self._text_id = texts, text_id
        self.memo: dict[tuple[int, int], tuple[int, int] | None] = {}
        # built from the end, so that the first rank of a merge listed twice is the one kept
        self._rank = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self._lazy = all(m.count(" ") == 1 and m[:1] != " " for m in self._rank)
        if not self._lazy:
            for pair, hit in self._table(merges):
                self.memo.setdefault(pair, hit)
        self._merges = merges

    def _table(self, merges: Sequence[str]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        get = self._text_id.get
        out = []
        for k, m in enumerate(merges):
            pos = m.find(" ", 1)
            a, b = (m[:pos], m[pos + 1 :]) if pos > 0 else ("", "")
            ia, ib, im = get(a), get(b), get(a + b)
            if ia is not None and ib is not None and im is not None:
                out.append(((ia, ib), (k, im)))
        return out

    def fill(self, pair: tuple[int, int]) -> tuple[int, int] | None:
        """Look ``pair`` up in the merge strings (and remember the answer)."""
        hit = None
        a, b = pair
        if self._lazy and a >= 0 and b >= 0:
            ta, tb = self._texts[a], self._texts[b]
            rank = self._rank.get(ta + " " + tb)
            if rank is not None:
                merged = self._text_id.get(ta + tb)
                hit = None if merged is None else (rank, merged)
        self.memo[pair] = hit
        return hit

    def get(self, pair: tuple[int, int], default: object = None) -> object:
        hit = self.memo[pair] if pair in self.memo else self.fill(pair)
        return default if hit is None else hit

    def items(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The whole table (built on demand: for :meth:`Tokenizer.merge_list` and saving)."""
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        for pair, hit in self._table(self._merges):
            seen.setdefault(pair, hit)
        return list(seen.items())

    def __len__(self) -> int:
        return len(self._rank)


_MISS = object()
# Below this many symbols the rescanning loop beats the heap's bookkeeping.
_SHORT = 24


def bpe_merge(
    ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]] | MergeRanks
) -> list[int]:
    """Merge ``ids`` by rank: ``ranks[(left, right)] = (rank, merged id)``.

    The lowest rank goes first and, between equal ranks, the leftmost pair. Ids that are in no
    pair of the table (negative placeholders, say) simply never merge.
    """
    if len(ids) < 2:
        return list(ids)
    if isinstance(ranks, MergeRanks):
        get, fill = ranks.memo.get, ranks.fill
    else:
        get, fill = ranks.get, None
    if len(ids) <= _SHORT:
        return _bpe_rescan(list(ids), get, fill)
    return _bpe_heap(ids, get, fill)


def _bpe_rescan(ids: list[int], get, fill) -> list[int]:  # type: ignore[no-untyped-def]
    while len(ids) > 1:
        best_rank, best_i, best_id = None, -1, -1
        for i in range(len(ids) - 1):
            hit = get((ids[i], ids[i + 1]), _MISS)
            if hit is _MISS:
                hit = fill((ids[i], ids[i + 1])) if fill is not None else None
            if hit is not None and (best_rank is None or hit[0] < best_rank):
                best_rank, best_i, best_id = hit[0], i, hit[1]
        if best_rank is None:
            break
        ids[best_i : best_i + 2] = [best_id]
    return ids


def _bpe_heap(ids: list[int], get, fill) -> list[int]:  # type: ignore[no-untyped-def]
    def look(a: int, b: int) -> tuple[int, int] | None:
        hit = get((a, b), _MISS)
        if hit is _MISS:
            return fill((a, b)) if fill is not None else None
        return hit

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
        hit = look(sym[i], sym[i + 1])
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
            hit = look(merged, sym[k])
            if hit is not None:
                heappush(heap, (hit[0], i, merged, sym[k], hit[1]))
        p = prv[i]
        if p >= 0:
            hit = look(sym[p], merged)
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
