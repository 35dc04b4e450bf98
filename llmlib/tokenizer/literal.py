"""Literal tokens in text: special tokens (when allowed) and added tokens are cut out of the text
before the pre-tokenizer sees it, by one of two rules.

- :func:`split_leftmost`: at each place, the longest token that starts there (Hugging Face's
  added-token trie, tiktoken's special-token regex);
- :func:`split_longest_first`: llama.cpp's, every occurrence of the longest token (in UTF-8
  bytes) first, left to right, then the next longest in the text that is left, and so on.

They differ only where tokens overlap in the text (with ``ab`` and ``bcd`` in ``abcd``, the
first gives ``ab|cd``, the second ``a|bcd``). A token may also swallow the whitespace before or
after it (llama.cpp's lstrip/rstrip attributes, set for Phi-3's special tokens).
"""

from __future__ import annotations

import functools

import regex


@functools.lru_cache(maxsize=64)
def special_splitter(allowed: frozenset[str]) -> regex.Pattern[str]:
    """A regex that splits text around the allowed special tokens (longest first, so that
    ``<|a|>x`` never shadows ``<|a|>xy``), keeping them as separate parts."""
    return regex.compile(
        "(" + "|".join(regex.escape(s) for s in sorted(allowed, key=len, reverse=True)) + ")"
    )


# what C's isspace() calls whitespace: what llama.cpp strips around a token with lstrip/rstrip
_C_SPACE = " \t\n\v\f\r"


def split_longest_first(
    text: str, table: dict[str, int], strip: dict[int, tuple[bool, bool]]
) -> list[str | int]:
    """llama.cpp's cut around literal tokens: the longest token (in UTF-8 bytes) first, each of
    its occurrences left to right, then the next longest in the text that is left, and so on."""
    order = sorted(
        ((s, i) for s, i in table.items() if s and s in text),
        key=lambda t: (-len(t[0].encode("utf-8")), t[1]),
    )
    parts: list[str | int] = [text]
    for s, tid in order:
        lstrip, rstrip = strip.get(tid, (False, False))
        out: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or s not in part:
                out.append(part)
                continue
            pos = 0
            while (k := part.find(s, pos)) >= 0:
                left = part[pos:k].rstrip(_C_SPACE) if lstrip else part[pos:k]
                if left:
                    out.append(left)
                out.append(tid)
                pos = k + len(s)
                if rstrip:
                    while pos < len(part) and part[pos] in _C_SPACE:
                        pos += 1
            if pos < len(part):
                out.append(part[pos:])
        parts = out
    return parts


def strip_around(parts: list[str | int], strip: dict[int, tuple[bool, bool]]) -> list[str | int]:
    """Drop the whitespace that a token with lstrip (rstrip) swallows before (after) it."""
    out: list[str | int] = []
    for k, p in enumerate(parts):
        if isinstance(p, str):
            prev, nxt = parts[k - 1] if k else None, parts[k + 1] if k + 1 < len(parts) else None
            if isinstance(prev, int) and strip.get(prev, (False, False))[1]:
                p = p.lstrip(_C_SPACE)
            if isinstance(nxt, int) and strip.get(nxt, (False, False))[0]:
                p = p.rstrip(_C_SPACE)
            if not p:
                continue
        out.append(p)
    return out


def split_leftmost(text: str, table: dict[str, int]) -> list[str | int]:
    """Cut ``text`` around the tokens of ``table`` (text -> id), longest match at each place."""
    parts: list[str | int] = []
    for k, part in enumerate(special_splitter(frozenset(table)).split(text)):
        if k % 2:
            parts.append(table[part])
        elif part:
            parts.append(part)
    return parts
