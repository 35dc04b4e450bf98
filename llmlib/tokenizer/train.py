"""Training byte-level BPE: start from the 256 bytes, repeatedly merge the most frequent pair.

The textbook loop (count every adjacent pair in the corpus, merge the winner, count again) does
work proportional to the corpus for every merge: hours for a few thousand merges on a few MB.
Two observations make it fast:

1. **Count unique pre-tokens, not text.** Pre-tokenization cuts the corpus into pieces that BPE
   never merges across, and natural text repeats them: Austen's 4 MB is ~900k pieces but only
   ~22k distinct ones. Each distinct piece becomes a "word" with a frequency; a pair's count is
   the sum over words of (occurrences in the word) x (word frequency).
2. **Update counts incrementally.** A merge only changes the words that contain the merged pair.
   An index ``pair -> words containing it`` finds them; for each, the old pairs' counts go down
   and the new pairs' counts go up by the word's frequency. A heap holds candidate pairs; an entry
   whose stored count no longer matches the live count is stale and skipped when popped ("lazy
   invalidation"), because every change of a count pushes a fresh entry.

Tie-breaking (documented, deterministic): among pairs with the same count, the winner is the
pair whose left token is "oldest", then whose right token is oldest. Merged tokens are ordered
by creation; the 256 byte tokens come before all merges, ordered by the printable character
that stands for each byte in the GPT-2 byte-level alphabet (the order Hugging Face
``tokenizers`` uses for its initial alphabet). So llmlib and ``tokenizers`` pick the same merges.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

from tqdm import tqdm  # the plain text bar: works in terminals and in executed notebooks alike

from llmlib.tokenizer.bytelevel import bytes_to_unicode
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.pretokenize import compile_pattern


def count_pretokens(text_or_iterable: str | Iterable[str], pattern: str = "gpt4") -> Counter[str]:
    """How often each distinct pre-token occurs (text given whole or as an iterable of chunks)."""
    rx = compile_pattern(pattern)
    if isinstance(text_or_iterable, str):
        return Counter(rx.findall(text_or_iterable))
    if isinstance(text_or_iterable, (bytes, bytearray)) or not isinstance(
        text_or_iterable, Iterable
    ):
        raise TypeError(
            f"text must be a str or an iterable of str, got {type(text_or_iterable).__name__}"
        )
    counts: Counter[str] = Counter()
    for k, chunk in enumerate(text_or_iterable):
        if not isinstance(chunk, str):
            raise TypeError(f"text[{k}] must be str, got {type(chunk).__name__}")
        counts.update(rx.findall(chunk))
    return counts


def train_bpe(
    text: str | Iterable[str],
    vocab_size: int,
    pattern: str = "gpt4",
    special_tokens: Iterable[str] = (),
    min_frequency: int = 2,
    progress: bool = True,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer.

    Args:
        text: the corpus, a str or an iterable of str (e.g. lines or documents).
        vocab_size: total vocabulary size, counting the 256 byte tokens and the special tokens;
            ``vocab_size - 256 - len(special_tokens)`` merges are learned (fewer if the corpus
            runs out of pairs seen at least ``min_frequency`` times).
        pattern: pre-tokenizer, a name in :data:`llmlib.tokenizer.PATTERNS` or a regex.
        special_tokens: texts given ids after all merges (e.g. ``"<|endoftext|>"``).
        min_frequency: stop when the best pair occurs fewer times than this.
        progress: show a tqdm progress bar over merges.

    Ids: 0-255 are the bytes (id = byte value), 256.. the merges in order, then the specials.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    special_tokens = list(special_tokens)
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens):
        raise TypeError("special_tokens must be an iterable of non-empty str")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens has duplicates: {special_tokens}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"vocab_size must be at least 256 (the byte tokens) + {len(special_tokens)} "
            f"special tokens = {256 + len(special_tokens)}, got {vocab_size}"
        )
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")

    counts = count_pretokens(text, pattern)
    merges = learn_merges(counts, vocab_size - 256 - len(special_tokens), min_frequency, progress)

    vocab = {b: bytes([b]) for b in range(256)}
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = vocab[a] + vocab[b]
    n = 256 + len(merges)
    specials = {s: n + k for k, s in enumerate(special_tokens)}
    eos = specials.get("<|endoftext|>")
    return Tokenizer(vocab, merges, pattern, specials, eos_id=eos)


def learn_merges(
    word_counts: dict[str, int], num_merges: int, min_frequency: int = 2, progress: bool = True
) -> list[tuple[int, int]]:
    """The BPE merge loop over distinct words; returns merges as pairs of ids (new id = 256 + index)."""
    # words as lists of byte ids; a one-byte word has no pair and never changes
    words: list[list[int]] = []
    freqs: list[int] = []
    for w, f in word_counts.items():
        b = w.encode("utf-8")
        if len(b) > 1:
            words.append(list(b))
            freqs.append(f)

    # tie-break order of tokens (see module docstring): bytes by their byte-level character
    order = sorted(range(256), key=lambda b: bytes_to_unicode()[b])
    age = [0] * (256 + num_merges)
    for rank, b in enumerate(order):
        age[b] = rank

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, w in enumerate(words):
        f = freqs[wi]
        for pair in zip(w, w[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + f
            s = where.get(pair)
            if s is None:
                where[pair] = {wi}
            else:
                s.add(wi)
    heap = [(-c, age[a], age[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    # at most one redraw a second: an executed notebook keeps every redraw of the bar
    bar = tqdm(
        total=num_merges, desc="BPE merges", unit="merge", disable=not progress, mininterval=1.0
    )
    while len(merges) < num_merges and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        pair = (a, b)
        count = pair_counts.get(pair, 0)
        if -negc != count:  # stale entry: a fresher one for this pair is (or was) in the heap
            continue
        if count < min_frequency:
            break
        new_id = 256 + len(merges)
        merges.append(pair)
        age[new_id] = 256 + len(merges)
        bar.update(1)

        changed: set[tuple[int, int]] = set()
        for wi in where.pop(pair):
            w = words[wi]
            # the index only grows, so a listed word may no longer hold the pair: check cheaply
            n = len(w)
            i = 0
            found = False
            while i < n - 1:
                if w[i] == a and w[i + 1] == b:
                    found = True
                    break
                i += 1
            if not found:
                continue
            f = freqs[wi]
            # Rebuild the word with the pair merged left to right, non-overlapping. Only pairs
            # that touch a merged span change: take those old pairs out of the counts ...
            new = w[:i]
            last = -1  # last old pair position already taken out (adjacent spans share one)
            while i < n:
                if i < n - 1 and w[i] == a and w[i + 1] == b:
                    for j in (i - 1, i, i + 1):
                        if j > last and 0 <= j < n - 1:
                            p = (w[j], w[j + 1])
                            pair_counts[p] -= f
                            changed.add(p)
                            last = j
                    new.append(new_id)
                    i += 2
                else:
                    new.append(w[i])
                    i += 1
            # ... and put in the pairs that hold the new token (each once)
            m = len(new)
            for k in range(m):
                if new[k] != new_id:
                    continue
                if k > 0 and new[k - 1] != new_id:
                    p = (new[k - 1], new_id)
                    pair_counts[p] = pair_counts.get(p, 0) + f
                    changed.add(p)
                    where.setdefault(p, set()).add(wi)
                if k + 1 < m:
                    p = (new_id, new[k + 1])
                    pair_counts[p] = pair_counts.get(p, 0) + f
                    changed.add(p)
                    where.setdefault(p, set()).add(wi)
            words[wi] = new
        pair_counts.pop(pair, None)
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, age[p[0]], age[p[1]], p[0], p[1]))
            elif p in pair_counts:
                del pair_counts[p]
    bar.close()
    return merges
