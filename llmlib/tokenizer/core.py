"""The tokenizer: text -> pieces (regex) -> bytes -> token ids (BPE merges by rank), and back.

One class serves every tokenizer llmlib reads or trains. A token is a byte string; the merge
table maps an adjacent pair of token ids to ``(rank, merged id)``. Encoding a piece starts from
its bytes (one token each) and repeatedly merges the adjacent pair of lowest rank, leftmost
first, until no pair is in the table. That is the rule of Hugging Face's BPE model, of
tiktoken (whose "rank" is the rank of the merged token) and of llama.cpp, so the same loop
reproduces all of them; only the tables differ.

Speed comes from the pre-token cache: natural text repeats its words, so almost every piece
after the first few thousand is a dictionary hit and the merge loop never runs.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from typing import Literal

import regex

from llmlib.tokenizer.export import save_tokenizer
from llmlib.tokenizer.literal import split_leftmost, split_longest_first, strip_around
from llmlib.tokenizer.merge import bpe_merge
from llmlib.tokenizer.pretokenize import (
    compile_pattern,
    compile_sequence,
    pattern_name,
    resolve_pattern,
    split_sequence,
)

# Above this many cached pieces the cache is dropped and rebuilt, so memory stays bounded on
# adversarial input (say, a long stream of random strings) while real text stays all hits.
_CACHE_LIMIT = 1 << 18


class Tokenizer:
    """Byte-level BPE tokenizer (and the base of :class:`~llmlib.tokenizer.spm.SentencePieceTokenizer`).

    Build one with :func:`llmlib.train_bpe` or :func:`llmlib.load_tokenizer`; the constructor
    is the low-level door that both use.

    Args:
        vocab: ``id -> token bytes`` for every ordinary token (all 256 single bytes must be there).
        merges: the merge list in rank order, as pairs of ids ``(left, right)``; the merged token
            is the concatenation of their bytes and must be in ``vocab``.
        pattern: a pattern name from :data:`llmlib.tokenizer.PATTERNS` or a regex string (its
            matches are the pieces, as in tiktoken); or a tuple of regexes applied in turn, each
            cutting every piece into its matches and the text between them (llama.cpp's and
            Hugging Face's sequences; see :func:`~llmlib.tokenizer.pretokenize.split_sequence`).
        special_tokens: ``text -> id`` of tokens matched literally in text (when allowed) and
            never produced by BPE.
        added_tokens: ``text -> id`` of tokens matched literally in text *always*, before the
            pre-tokenizer sees it (GGUF's user-defined tokens, such as GPT-NeoX's runs of
            spaces); they are not special, so text may contain them freely.
        special_match: how literal tokens are found. ``"leftmost"``: at each place the longest
            token that starts there (Hugging Face, tiktoken). ``"longest_first"``: llama.cpp's
            rule, every occurrence of the longest token first, then the next longest in what is
            left, and so on.
        token_strip: ``id -> (lstrip, rstrip)`` for literal tokens that swallow the whitespace
            before or after them (llama.cpp's attributes, Phi-3's ``</s>``).
        ignore_merges: if a whole piece is itself a token, emit it without merging (tiktoken
            and Llama-3 do this; for a vocabulary built by merges it changes nothing).
        merge_ranks: instead of ``merges``, an explicit ``(left, right) -> (rank, merged id)``
            table (tiktoken files, where one token may be reachable by several splits; GGUF
            files, whose merges are looked up by token text). ``merges``, if given too, is kept
            as the merge list.
        bos_id, eos_id, chat_template, add_bos: what the model around the tokenizer expects
            (read from GGUF metadata or ``tokenizer_config.json``).
    """

    #: what a GGUF file calls this tokenizer (``tokenizer.ggml.model``, ``tokenizer.ggml.pre``)
    gguf_model: str | None = None
    gguf_pre: str | None = None
    #: whether the model expects ``eos_id`` after every prompt (GGUF's add_eos_token; BERT-style
    #: encoders do), which, like ``add_bos``, the caller adds
    add_eos: bool = False

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[int, int]] | None = None,
        pattern: str | tuple[str, ...] | None = "gpt4",
        special_tokens: dict[str, int] | None = None,
        *,
        added_tokens: dict[str, int] | None = None,
        special_match: Literal["leftmost", "longest_first"] = "leftmost",
        token_strip: dict[int, tuple[bool, bool]] | None = None,
        ignore_merges: bool = False,
        merge_ranks: dict[tuple[int, int], tuple[int, int]] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        chat_template: str | None = None,
        name: str | None = None,
        add_bos: bool = False,
    ) -> None:
        special_tokens = dict(special_tokens or {})
        added_tokens = dict(added_tokens or {})
        if special_match not in ("leftmost", "longest_first"):
            raise ValueError(
                f"special_match must be 'leftmost' or 'longest_first', got {special_match!r}"
            )
        self.pattern: str | tuple[str, ...] | None
        if pattern is None:  # no pre-tokenizer (a subclass cuts the text its own way)
            self.pattern, self._split = None, None
        elif isinstance(pattern, (tuple, list)):
            self.pattern = tuple(resolve_pattern(p) for p in pattern)
            rules = compile_sequence(self.pattern)
            self._split = functools.partial(split_sequence, rules=rules)
        else:
            self.pattern = resolve_pattern(pattern)
            self._split = compile_pattern(self.pattern).findall
        self.pattern_name: str | None = pattern_name(self.pattern)
        self.special_tokens: dict[str, int] = special_tokens
        self.added_tokens: dict[str, int] = added_tokens
        self.special_match = special_match
        self.token_strip: dict[int, tuple[bool, bool]] = dict(token_strip or {})
        self.ignore_merges = ignore_merges
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.name = name
        # whether the model expects ``bos_id`` in front of every prompt (GGUF's
        # tokenizer.ggml.add_bos_token); encode() never adds it, the caller does
        self.add_bos = add_bos

        literal = {**added_tokens, **special_tokens}
        size = 1 + max([*vocab, *literal.values()], default=-1)
        self._id_to_bytes: list[bytes | None] = [None] * size
        for i, b in vocab.items():
            self._id_to_bytes[i] = b
        for s, i in literal.items():
            self._id_to_bytes[i] = s.encode("utf-8")
        self._bytes_to_id: dict[bytes, int] = {b: i for i, b in vocab.items()}
        # a whole piece or a merge may spell a literal token too (llama.cpp looks every text up
        # among all tokens); ordinary tokens win where both have the same bytes
        self._any_id: dict[bytes, int] = {s.encode("utf-8"): i for s, i in literal.items()}
        self._any_id.update(self._bytes_to_id)
        # byte value -> id of its single-byte token (the identity for trained tokenizers,
        # a permutation for Hugging Face files). Some real vocabularies lack a few bytes
        # (SmolLM2 has no token for 21 control bytes and bytes that never occur in UTF-8);
        # like Hugging Face's BPE without an unknown token, such bytes are dropped.
        self._byte_ids: list[int | None] = [self._bytes_to_id.get(bytes([b])) for b in range(256)]
        self.missing_bytes: bytes = bytes(b for b in range(256) if self._byte_ids[b] is None)

        if merge_ranks is None:
            merge_ranks = {}
            table = self._id_to_bytes
            for rank, (a, b) in enumerate(merges or []):
                ba = table[a] if 0 <= a < size else None
                bb = table[b] if 0 <= b < size else None
                merged = self._any_id.get(ba + bb) if ba is not None and bb is not None else None
                if merged is None:
                    raise ValueError(f"merges[{rank}]: ({a}, {b}) does not make a token in vocab")
                merge_ranks.setdefault((a, b), (rank, merged))
            self.merges: list[tuple[int, int]] | None = list(merges or [])
        else:  # rank table given directly (with the merge list it came from, if any)
            self.merges = list(merges) if merges is not None else None
        self._ranks = merge_ranks
        self._cache: dict[str, list[int]] = {}
        self._special_regex: regex.Pattern[str] | None = None

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """One past the largest id (ids may have gaps, as in cl100k's special tokens)."""
        return len(self._id_to_bytes)

    def id_to_bytes(self, i: int) -> bytes:
        """The bytes of token ``i`` (a special token's bytes are its UTF-8 text)."""
        try:
            b = self._id_to_bytes[i] if i >= 0 else None
        except (IndexError, TypeError):
            b = None
        if b is None:
            raise ValueError(f"token id {i!r} is not in this vocabulary (size {self.vocab_size})")
        return b

    def token_to_id(self, token: bytes | str) -> int:
        """Id of an ordinary token given as bytes, or of a special token given as text."""
        if isinstance(token, str):
            if token in self.special_tokens:
                return self.special_tokens[token]
            if token in self.added_tokens:
                return self.added_tokens[token]
            token = token.encode("utf-8")
        if token not in self._bytes_to_id:
            raise KeyError(f"{token!r} is not a token")
        return self._bytes_to_id[token]

    def merge_list(self) -> list[tuple[int, int]]:
        """The merges in rank order (for a rank table, every split that makes a token)."""
        if self.merges is not None:
            return list(self.merges)
        return [pair for pair, _ in sorted(self._ranks.items(), key=lambda kv: (kv[1][0], kv[0]))]

    def vocab(self) -> dict[int, bytes]:
        """``id -> bytes`` of the ordinary tokens (neither special nor added)."""
        special = {*self.special_tokens.values(), *self.added_tokens.values()}
        return {i: b for i, b in enumerate(self._id_to_bytes) if b is not None and i not in special}

    # ------------------------------------------------------------------ encoding
    def _bpe(self, piece: bytes) -> list[int]:
        """Merge one piece's bytes by rank until no adjacent pair is in the merge table."""
        if self.ignore_merges:
            whole = self._any_id.get(piece)
            if whole is not None:
                return [whole]
        byte_ids = self._byte_ids
        ids = [byte_ids[b] for b in piece]
        if self.missing_bytes and None in ids:
            ids = [i for i in ids if i is not None]
        return bpe_merge(ids, self._ranks)

    def clear_cache(self) -> None:
        """Forget the encoded pre-tokens (for cold-start timing; results never depend on it)."""
        self._cache.clear()

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode ``text`` treating special-token text as ordinary text (added tokens, which are
        not special, are still cut out: llama.cpp's ``parse_special=false``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if self.added_tokens:
            return self._encode_parts(self._literal_parts(text, ()))
        return self._encode_text(text, True)

    def _encode_parts(self, parts: list[str | int], after_token: bool = True) -> list[int]:
        """Ids of text fragments and literal-token ids in order."""
        out: list[int] = []
        for part in parts:
            if isinstance(part, int):
                out.append(part)
                after_token = True
            else:
                out.extend(self._encode_text(part, after_token))
                after_token = False
        return out

    def _encode_text(self, text: str, after_token: bool) -> list[int]:
        """One fragment of plain text (no literal tokens in it): pre-tokenize, merge each piece.

        ``after_token``: the fragment starts the text or follows a literal token (SentencePiece
        puts a space there; byte-level BPE does not care).
        """
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        get = cache.get
        out: list[int] = []
        extend = out.extend
        for piece in self._split(text):  # type: ignore[misc]
            ids = get(piece)
            if ids is None:
                ids = cache[piece] = self._bpe(piece.encode("utf-8"))
            extend(ids)
        return out

    def encode_bytes(self, data: bytes) -> list[int]:
        """Encode arbitrary bytes: valid UTF-8 runs as text, each invalid byte as its byte token.

        ``decode_bytes(encode_bytes(b)) == b`` for every byte string (except bytes the
        vocabulary has no token for, see ``missing_bytes``).
        """
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        out: list[int] = []
        data = bytes(data)
        first = True  # only the very start counts as "after a token" (SentencePiece's space)
        while data:
            try:
                text, bad = data.decode("utf-8"), None
            except UnicodeDecodeError as e:
                text, bad = data[: e.start].decode("utf-8"), e.start
            if text:
                out.extend(self._encode_parts(self._literal_parts(text, ()), first))
            if bad is None:
                break
            out.extend(i for i in self._byte_ids[data[bad] : data[bad] + 1] if i is not None)
            data, first = data[bad + 1 :], False
        return out

    def encode(
        self,
        text: str,
        *,
        allowed_special: Literal["all"] | Collection[str] = (),
        disallowed_special: Literal["all"] | Collection[str] = "all",
    ) -> list[int]:
        """Encode ``text`` to token ids.

        Special tokens follow tiktoken's rule: a special token's text is turned into its id only
        if it is in ``allowed_special`` ("all" or a set of strings). If the text contains one that
        is in ``disallowed_special`` (by default every special token not allowed), that is a
        ValueError: text from a user must not be able to forge an ``<|im_end|>``. Pass
        ``disallowed_special=()`` to encode such text as plain characters instead.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        allowed = set(self.special_tokens) if allowed_special == "all" else set(allowed_special)
        unknown = allowed - set(self.special_tokens)
        if unknown:
            raise ValueError(
                f"allowed_special: not special tokens of this tokenizer: {sorted(unknown)}"
            )
        if disallowed_special == "all":
            disallowed = set(self.special_tokens) - allowed
        else:
            disallowed = set(disallowed_special)
        if disallowed:
            found = [s for s in disallowed if s in text]
            if found:
                raise ValueError(
                    f"text contains special token(s) {sorted(found)} that are not allowed; pass "
                    f"allowed_special={{...}} (or 'all') to encode them as special tokens, or "
                    f"disallowed_special=() to encode them as ordinary text"
                )
        if not allowed and not self.added_tokens:
            return self._encode_text(text, True)
        return self._encode_parts(self._literal_parts(text, allowed))

    def _literal_parts(self, text: str, allowed: Collection[str]) -> list[str | int]:
        """Cut ``text`` around the literal tokens: the allowed special ones and the added ones."""
        table = dict(self.added_tokens)
        table.update((s, self.special_tokens[s]) for s in allowed)
        if not table:
            return [text] if text else []
        if self.special_match == "longest_first":
            return split_longest_first(text, table, self.token_strip)
        parts = split_leftmost(text, table)
        return strip_around(parts, self.token_strip) if self.token_strip else parts

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes behind ``ids`` (a token may hold part of a UTF-8 character)."""
        table = self._id_to_bytes
        ids = ids if isinstance(ids, list) else list(ids)
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids])  # type: ignore[misc]
        except (IndexError, TypeError):
            bad = [
                i
                for i in ids
                if not isinstance(i, int) or not 0 <= i < len(table) or table[i] is None
            ]
            raise ValueError(
                f"ids: {bad[:5]} are not in this vocabulary (size {len(table)})"
            ) from None

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Decode to text; bytes that are not valid UTF-8 become U+FFFD (``errors="replace"``)."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def pieces(self, text: str, **encode_kwargs: object) -> list[str]:
        """The tokens of ``encode(text)`` as readable strings, for showing how text was cut.

        A token that is not whole UTF-8 (part of a character) shows its bytes as ``\\xNN``.
        """
        ids = self.encode(text, **encode_kwargs)  # type: ignore[arg-type]
        return [self.id_to_bytes(i).decode("utf-8", errors="backslashreplace") for i in ids]

    # ------------------------------------------------------------------ files
    def save(self, path: str) -> None:
        """Write a Hugging Face ``tokenizer.json`` (loads in ``tokenizers.Tokenizer.from_file``)."""
        save_tokenizer(self, path)

    def __repr__(self) -> str:
        pat = self.pattern_name or (
            "custom regex"
            if isinstance(self.pattern, str)
            else f"{len(self.pattern or ())} regexes"
        )
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self._ranks)}, pattern={pat!r}, "
            f"special_tokens={len(self.special_tokens)})"
        )
