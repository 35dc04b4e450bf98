"""BERT's WordPiece, as llama.cpp runs it on a GGUF vocabulary (``tokenizer.ggml.model`` "bert").

WordPiece does not merge; it normalizes the text, cuts it into words, and covers each word
greedily with the longest token that fits:

1. normalize (BERT's uncased rule): every character to the first character of its canonical
   decomposition (``é`` -> ``e``, llama.cpp's one-character NFD), combining marks, control
   characters and U+FFFD dropped, letters lowercased;
2. cut into words at whitespace; every punctuation mark, ASCII symbol and CJK ideograph is a
   word by itself;
3. write each word with a leading ``▁`` and take, from left to right, the longest token that
   matches there; a word with any place no token matches becomes the unknown token.

So decoding cannot give the text back: case, accents and the spacing around punctuation are
gone (``decode(encode("Hello, World!")) == "hello , world !"``).
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Iterable

import regex

from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.spm import CONTROL, SPACE, UNKNOWN, USER_DEFINED

_CLASS = {
    name: regex.compile(pat)
    for name, pat in (
        ("space", r"\s"),
        ("control", r"\p{C}"),
        ("mark", r"\p{M}"),
        ("punct", r"\p{P}"),
        ("symbol", r"\p{S}"),
    )
}


@functools.lru_cache(maxsize=1 << 16)
def _normalize_char(c: str, lowercase: bool, strip_accents: bool) -> tuple[str, str]:
    """(what the character becomes, its role: "space", "drop", "alone" or "word")."""
    if strip_accents:
        c = unicodedata.normalize("NFD", c)[0]
    cpt = ord(c)
    if _CLASS["space"].match(c):
        return "", "space"
    if cpt == 0 or cpt == 0xFFFD or _CLASS["control"].match(c):
        return "", "drop"
    if strip_accents and _CLASS["mark"].match(c):
        return "", "drop"
    if lowercase:
        low = c.lower()
        c = low if len(low) == 1 else low[0]  # U+0130 İ: simple lowercase is i
    alone = (
        _CLASS["punct"].match(c) is not None
        or (cpt < 0x7F and _CLASS["symbol"].match(c) is not None)
        or _is_cjk(cpt)
    )
    return c, "alone" if alone else "word"


def _is_cjk(cpt: int) -> bool:
    return (
        0x4E00 <= cpt <= 0x9FFF
        or 0x3400 <= cpt <= 0x4DBF
        or 0x20000 <= cpt <= 0x2A6DF
        or 0x2A700 <= cpt <= 0x2B73F
        or 0x2B740 <= cpt <= 0x2B81F
        or 0x2B920 <= cpt <= 0x2CEAF  # sic: Hugging Face's range, as llama.cpp copies it
        or 0xF900 <= cpt <= 0xFAFF
        or 0x2F800 <= cpt <= 0x2FA1F
    )


def words(text: str, lowercase: bool = True, strip_accents: bool = True) -> list[str]:
    """BERT's normalization and word split (steps 1 and 2 of the module docstring)."""
    out: list[str] = []
    cur: list[str] = []
    for ch in text:
        c, role = _normalize_char(ch, lowercase, strip_accents)
        if role == "word":
            cur.append(c)
        elif role == "alone":
            if cur:
                out.append("".join(cur))
                cur = []
            out.append(c)
        elif role == "space" and cur:
            out.append("".join(cur))
            cur = []
    if cur:
        out.append("".join(cur))
    return out


class WordPieceTokenizer(Tokenizer):
    """A WordPiece vocabulary (see the module docstring): ``tokens`` by id, ``kinds`` their
    GGUF token types, ``unk_id`` the id a word no token covers becomes."""

    def __init__(
        self,
        tokens: list[str],
        kinds: list[int],
        *,
        unk_id: int,
        lowercase: bool = True,
        strip_accents: bool = True,
        literal_kinds: dict[int, str] | None = None,
        **kwargs: object,
    ) -> None:
        literal_kinds = dict(literal_kinds or {})
        vocab: dict[int, bytes] = {}
        specials: dict[str, int] = {}
        added: dict[str, int] = {}
        for i, (t, k) in enumerate(zip(tokens, kinds)):
            role = literal_kinds.get(i)
            if role is None and k in (CONTROL, UNKNOWN):
                role = "special"
            elif role is None and k == USER_DEFINED:
                role = "added"
            if role == "special":
                specials[t] = i
            elif role == "added":
                added[t] = i
            else:
                vocab[i] = t.replace(SPACE, " ").encode("utf-8")
        super().__init__(
            vocab, None, None, specials, added_tokens=added, special_match="longest_first", **kwargs
        )  # type: ignore[arg-type]
        self.tokens = list(tokens)
        self.unk_id = unk_id
        self.lowercase, self.strip_accents = lowercase, strip_accents
        # llama.cpp matches byte substrings against every token's text
        self._utf8_id = {t.encode("utf-8"): i for i, t in enumerate(tokens)}
        self._max_len = max(len(t) for t in self._utf8_id)

    def _encode_text(self, text: str, after_token: bool) -> list[int]:
        get, longest = self._utf8_id.get, self._max_len
        out: list[int] = []
        for w in words(text, self.lowercase, self.strip_accents):
            cached = self._cache.get(w)
            if cached is None:
                b = (SPACE + w).encode("utf-8")
                ids: list[int] = []
                i, n = 0, len(b)
                while i < n:
                    for j in range(min(n, i + longest), i, -1):
                        t = get(b[i:j])
                        if t is not None:
                            ids.append(t)
                            i = j
                            break
                    else:
                        ids = [self.unk_id]
                        break
                cached = self._cache[w] = ids
            out.extend(cached)
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes behind ``ids``, less the leading space of the first word."""
        raw = super().decode_bytes(ids)
        return raw[1:] if raw[:1] == b" " else raw

    def save(self, path: str | os.PathLike[str]) -> None:
        raise ValueError("a WordPiece vocabulary cannot be saved as a byte-level tokenizer.json")

    def __repr__(self) -> str:
        return (
            f"WordPieceTokenizer(vocab_size={self.vocab_size}, lowercase={self.lowercase}, "
            f"special_tokens={len(self.special_tokens)})"
        )
