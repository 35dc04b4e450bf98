"""SentencePiece-style vocabularies: Llama 2 and Phi-3 (merges by score), Gemma 4 (merges by rank).

These vocabularies are not byte-level. A token is a piece of UTF-8 text in which a space is
written ``▁`` (U+2581); a character the vocabulary lacks is spelled in byte tokens ``<0x41>``
("byte fallback"). Encoding a fragment of text (the text between literal tokens) goes:

1. put a space in front if the fragment starts the text or follows a literal token
   (``tokenizer.ggml.add_space_prefix``; Llama 2 and Phi-3 do, Gemma 4 does not);
2. write every space as ``▁``;
3. merge, starting from single characters:

   - SentencePiece (``tokenizer.ggml.model`` "llama"): the whole fragment at once; any two
     adjacent pieces whose concatenation is a token may merge, the token with the highest
     score first (:func:`~llmlib.tokenizer.merge.spm_merge`);
   - Gemma 4 ("gemma4"): each line, and each run of newlines, on its own; pairs merge by the
     rank of the merge list, as in byte-level BPE but over characters;

4. spell every piece that is not a token in byte tokens.

Decoding turns ``▁`` back into spaces and byte tokens into their bytes, and drops the space that
step 1 added, so that ``decode(encode(s)) == s``. :meth:`id_to_bytes` keeps that space (a token
in the middle of a stream, ``▁world``, means " world").

This is llama.cpp's algorithm (``llm_tokenizer_spm_session`` and its BPE session for Gemma 4),
with llama.cpp's rule of looking every piece up among *all* tokens, control tokens included.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import regex

from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.merge import MergeRanks, bpe_merge, spm_merge

SPACE = "\u2581"  # ▁, SentencePiece's visible space

# what a token is (llama.cpp's LLAMA_TOKEN_TYPE_*, GGUF's tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

_NEWLINE_RUNS = regex.compile(r"[^\n]+|\n+")
_BYTE_TOKEN = regex.compile(r"<0x([0-9A-Fa-f]{2})>")
_CACHE_LIMIT = 1 << 16
_CACHE_PIECE = 256  # fragments longer than this are not cached


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece-style vocabulary (see the module docstring).

    Args:
        tokens: every token's text, by id (``▁`` for a space, ``<0x0A>`` for a byte token).
        kinds: every token's type (:data:`NORMAL`, :data:`BYTE`, :data:`CONTROL`, ...): control
            and unknown tokens are the special tokens (matched in text only when allowed),
            user-defined ones are added tokens (always matched), byte tokens stand for a byte,
            unused ones for nothing.
        scores: per token, for SentencePiece merging (the higher, the earlier).
        merges: instead of scores, the merge list in rank order, ``"left right"`` token texts
            (Gemma 4); each line is then merged on its own.
        add_space_prefix: put a space before a fragment that starts the text or follows a
            literal token.
        literal_kinds: override ``kinds`` for the literal tokens: ``id -> "special" | "added"``
            (llama.cpp's adjustments by token text, see :mod:`llmlib.tokenizer.gguf_vocab`).
        Other keywords go to :class:`~llmlib.tokenizer.core.Tokenizer`.
    """

    def __init__(
        self,
        tokens: list[str],
        kinds: list[int],
        scores: list[float] | None = None,
        merges: Sequence[str] | None = None,
        *,
        add_space_prefix: bool = True,
        literal_kinds: dict[int, str] | None = None,
        **kwargs: object,
    ) -> None:
        if len(kinds) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(kinds)} token types")
        if (scores is None) == (merges is None):
            raise ValueError("give scores (SentencePiece) or merges (BPE), not both or neither")
        if scores is not None and len(scores) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
        literal_kinds = dict(literal_kinds or {})
        vocab: dict[int, bytes] = {}
        specials: dict[str, int] = {}
        added: dict[str, int] = {}
        for i, (t, k) in enumerate(zip(tokens, kinds)):
            lit = literal_kinds.get(i)
            if lit is None and k in (CONTROL, UNKNOWN):
                lit = "special"
            elif lit is None and k == USER_DEFINED:
                lit = "added"
            if lit == "special":
                specials[t] = i
            elif lit == "added":
                added[t] = i
            elif k == BYTE and (m := _BYTE_TOKEN.fullmatch(t)):
                vocab[i] = bytes([int(m.group(1), 16)])
            elif k in (UNUSED, UNDEFINED):
                vocab[i] = b""  # llama.cpp writes nothing for these
            else:
                vocab[i] = t.replace(SPACE, " ").encode("utf-8")
        super().__init__(
            vocab, None, None, specials, added_tokens=added, special_match="longest_first", **kwargs
        )  # type: ignore[arg-type]
        self.tokens = list(tokens)
        self.kinds = list(kinds)
        self.add_space_prefix = add_space_prefix
        # llama.cpp's token_to_id: every text, the last id where two tokens share one
        self._text_id: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        self._scores = [float(x) for x in scores] if scores is not None else None
        # every two characters that stand next to each other in some token (all tokens: any
        # text may be looked up)
        self._pairs: frozenset[str] = frozenset(
            t[k : k + 2] for t in (tokens if scores is not None else ()) for k in range(len(t) - 1)
        )
        self._literal_ids = frozenset({*specials.values(), *added.values()})
        # byte b -> <0xBB>, else the one-character token (llama.cpp's byte_to_token)
        self._byte_ids = [
            self._text_id.get(f"<0x{b:02X}>", self._text_id.get(chr(b)) if b < 128 else None)
            for b in range(256)
        ]
        self.missing_bytes = bytes(b for b in range(256) if self._byte_ids[b] is None)
        if merges is not None:
            self._ranks = MergeRanks(merges, self.tokens, self._text_id)
        self._piece_cache: dict[str, list[int]] = {}

    @property
    def uses_scores(self) -> bool:
        """True for SentencePiece merging by score, False for BPE by rank (Gemma 4)."""
        return self._scores is not None

    def token_to_id(self, token: bytes | str) -> int:
        """Id of a token given by its text as the vocabulary writes it (``"▁Hello"``), of a
        special token, or of an ordinary token given by its bytes."""
        if isinstance(token, str) and token in self._text_id:
            return self._text_id[token]
        return super().token_to_id(token)

    def clear_cache(self) -> None:
        super().clear_cache()
        self._piece_cache.clear()

    # ------------------------------------------------------------------ encoding
    def _encode_text(self, text: str, after_token: bool) -> list[int]:
        if not text:
            return []
        if self.add_space_prefix and after_token:
            text = " " + text
        text = text.replace(" ", SPACE)
        cache = self._piece_cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        out: list[int] = []
        if self._scores is not None:
            for piece in self._independent(text):
                ids = cache.get(piece)
                if ids is None:
                    ids = self._spell(spm_merge(piece, self._text_id, self._scores))
                    if len(piece) <= _CACHE_PIECE:
                        cache[piece] = ids
                out.extend(ids)
            return out
        for piece in _NEWLINE_RUNS.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe_chars(piece)
                if len(piece) <= _CACHE_PIECE:
                    cache[piece] = ids
            out.extend(ids)
        return out

    def _independent(self, text: str) -> list[str]:
        """Cut ``text`` where no merge can ever cross: between two characters that are next to
        each other in no token. SentencePiece merges only pieces whose concatenation is a
        token, so a piece that spans such a place cannot arise, and the two sides merge
        exactly as they would together. (For Llama 2 that is before every ``▁`` that follows
        a letter: the cuts make words, which the cache then keeps.)"""
        pairs = self._pairs
        cuts = [i for i in range(1, len(text)) if text[i - 1 : i + 1] not in pairs]
        if not cuts:
            return [text]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    def _bpe_chars(self, piece: str) -> list[int]:
        """Gemma 4's BPE over the characters of one piece."""
        text_id = self._text_id
        if piece[0] == "\n" and piece in text_id:  # a run of newlines that is a token
            return [text_id[piece]]
        # a character that is not a token never merges; it keeps a negative placeholder
        ids = [text_id.get(c, -1 - k) for k, c in enumerate(piece)]
        merged = bpe_merge(ids, self._ranks)
        if min(merged) >= 0:
            return merged
        return self._spell([self.tokens[i] if i >= 0 else piece[-1 - i] for i in merged])

    def _spell(self, pieces: list[str]) -> list[int]:
        """Ids of final pieces: the token, else its UTF-8 bytes as byte tokens."""
        text_id, byte_ids = self._text_id, self._byte_ids
        out: list[int] = []
        for p in pieces:
            i = text_id.get(p)
            if i is not None:
                out.append(i)
            else:
                out.extend(b for b in (byte_ids[x] for x in p.encode("utf-8")) if b is not None)
        return out

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids) -> bytes:  # type: ignore[no-untyped-def]
        """The bytes behind ``ids``, less the space that encoding puts before a fragment that
        starts the text or follows a literal token (when ``add_space_prefix``)."""
        ids = ids if isinstance(ids, list) else list(ids)
        raw = super().decode_bytes(ids)  # checks the ids
        if not self.add_space_prefix:
            return raw
        table, literal = self._id_to_bytes, self._literal_ids
        parts = []
        strip = True
        for i in ids:
            b = table[i]
            if strip and b[:1] == b" ":
                b = b[1:]
            parts.append(b)
            strip = i in literal
        return b"".join(parts)  # type: ignore[arg-type]

    def save(self, path: str | os.PathLike[str]) -> None:
        raise ValueError(
            "a SentencePiece-style vocabulary cannot be saved as a byte-level tokenizer.json"
        )

    def __repr__(self) -> str:
        how = "scores" if self._scores is not None else f"merges={len(self._ranks)}"
        return (
            f"SentencePieceTokenizer(vocab_size={self.vocab_size}, {how}, "
            f"add_space_prefix={self.add_space_prefix}, special_tokens={len(self.special_tokens)}, "
            f"added_tokens={len(self.added_tokens)})"
        )
