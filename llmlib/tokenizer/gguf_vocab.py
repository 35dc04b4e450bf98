"""The tokenizer in a GGUF file's metadata, built the way llama.cpp builds it.

``tokenizer.ggml.model`` says which kind of vocabulary the file holds:

- ``"gpt2"``: byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek, Falcon, StarCoder, ...). Tokens are
  written through GPT-2's byte map; ``tokenizer.ggml.pre`` names the pre-tokenizer
  (:data:`~llmlib.tokenizer.gguf_pre.GGUF_PRE`); merges are ranked text pairs.
- ``"llama"``: SentencePiece (Llama 2, Phi-3, ...): token scores, byte-fallback tokens.
- ``"gemma4"``: Gemma 4's SentencePiece-style BPE (see :mod:`llmlib.tokenizer.spm`);
- ``"bert"``: BERT's WordPiece (:mod:`llmlib.tokenizer.wpm`).

Other kinds (``"t5"`` Unigram, ``"rwkv"``, ``"plamo2"``, ...) are refused with an error that names
them, as is an unknown pre-tokenizer name.

``tokenizer.ggml.token_type`` sorts the tokens. Control and unknown tokens are *special*: their
text becomes their id only where the caller allows it. User-defined tokens are *added*: they are
cut out of any text before the pre-tokenizer runs (GPT-NeoX's runs of spaces). llama.cpp then
adjusts a few tokens by their text, and so does :func:`token_roles`: end-of-generation and
fill-in-the-middle markers become control tokens even where the file calls them normal or
user-defined, a few chat markers become user-defined, and Phi-3's literal tokens swallow the
whitespace after them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmlib.tokenizer.bytelevel import byte_decoder, bytes_to_unicode
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.gguf_pre import GGUF_PRE
from llmlib.tokenizer.merge import MergeRanks
from llmlib.tokenizer.pretokenize import SMOLLM2
from llmlib.tokenizer.spm import (
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    SentencePieceTokenizer,
)
from llmlib.tokenizer.wpm import WordPieceTokenizer

# texts llama.cpp makes control tokens, whatever the file says (end-of-generation markers)
_EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
    "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> "
    "<end_of_utterance> <eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~[".split()
)
# fill-in-the-middle markers: where the file names none, one of these found becomes a control
# token (llama.cpp takes the first its hash map yields; we take the lowest id)
_FIM_TEXTS = {
    ("fim_pre", "prefix"): "<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> "
    "▁<PRE> <|code_prefix|> <|prefix|>",
    ("fim_suf", "suffix"): "<|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> "
    "▁<SUF> <|code_suffix|> <|suffix|>",
    ("fim_mid", "middle"): "<|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> "
    "▁<MID> <|code_middle|> <|middle|>",
    ("fim_pad", ""): "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]",
    ("fim_rep", ""): "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>",
    ("fim_sep", ""): "<|file_sep|>",
}
# gpt-oss's markers that llama.cpp always renders: user-defined
_ALWAYS_ADDED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

SUPPORTED = ("gpt2", "llama", "gemma4", "bert")


def token_roles(
    tokens: list[str], types: list[int], meta: dict[str, Any]
) -> tuple[dict[int, str], dict[int, tuple[bool, bool]]]:
    """llama.cpp's view of the literal tokens: ``id -> "special" | "added"`` for every token
    that is one (all others are ordinary), and ``id -> (lstrip, rstrip)`` where set."""
    text_id = {t: i for i, t in enumerate(tokens)}
    control = {i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)}
    user = {i for i, ty in enumerate(types) if ty == USER_DEFINED}
    normal: set[int] = set()

    def key(name: str) -> str:
        return f"tokenizer.ggml.{name}_token_id"

    for (name, old), texts in _FIM_TEXTS.items():
        if key(name) in meta or (old and key(old) in meta):
            continue
        found = [text_id[t] for t in texts.split() if t in text_id]
        if found:
            control.add(min(found))
    control.update(text_id[t] for t in _EOG_TEXTS if t in text_id)
    for t in _ALWAYS_ADDED:
        if t in text_id:
            control.discard(text_id[t])
            user.add(text_id[t])
    has = text_id.__contains__
    if has("<|end|>") and (
        (has("<|return|>") and has("<|call|>")) or (has("<|calls|>") and has("<|flush|>"))
    ):
        control.discard(text_id["<|end|>"])
        user.add(text_id["<|end|>"])
    eos = meta.get(key("eos"))
    eos_text = tokens[eos] if isinstance(eos, int) and 0 <= eos < len(tokens) else None
    if has("</s>") and (has("<|tool_response>") or eos_text == "<|plamo:eos|>"):
        s = text_id["</s>"]
        control.discard(s)
        user.discard(s)
        normal.add(s)
    roles = {i: "added" for i in user}
    roles.update((i, "special") for i in control)
    for i in normal:
        roles.pop(i, None)

    strip: dict[int, tuple[bool, bool]] = {}
    name = str(meta.get("general.name") or "").lower()
    pre = str(meta.get("tokenizer.ggml.pre") or "")
    arch = str(meta.get("general.architecture") or "")
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if has("<mask>"):
            strip[text_id["<mask>"]] = (True, False)
    elif "phi-3" in name or "phi3" in name:
        strip = dict.fromkeys(roles, (False, True))
        if has("</s>"):
            strip[text_id["</s>"]] = (False, True)
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            if has(t):
                strip.pop(text_id[t], None)
    elif "modern-bert" in name and has("[MASK]"):
        strip[text_id["[MASK]"]] = (True, False)
    return roles, strip


def load_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer stored in a GGUF file's metadata (see the module docstring).

    The header is parsed by :mod:`llmlib.gguf_file`, which keeps the last few files' headers:
    notebooks and tests open the same file many times, and a model's loader reads the same one.
    """
    p = Path(path)
    with _no_gc():  # ~a million small tuples and strings: collecting them meanwhile is waste
        return _build(p, _read_gguf_tokenizer(str(p.resolve())))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _build(p: Path, meta: dict[str, Any]) -> Tokenizer:
    where = repr(str(p))
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{where}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind not in SUPPORTED:
        what = {"t5": " (T5's Unigram)", "rwkv": " (RWKV's trie)"}.get(kind, "")
        raise ValueError(
            f"{where}: GGUF tokenizer type {kind!r}{what} is not supported; llmlib reads "
            f"{', '.join(map(repr, SUPPORTED))}"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError(f"{where}: GGUF tokenizer has no tokens (tokenizer.ggml.tokens)")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) < len(tokens):
        raise ValueError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    types = types[: len(tokens)]
    roles, strip = token_roles(tokens, types, meta)

    def tid(key: str, default: int | None = None) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        return int(v) if isinstance(v, int) and 0 <= v < len(tokens) else default

    def flag(key: str, default: bool) -> bool:
        v = meta.get(f"tokenizer.ggml.{key}")
        return bool(v) if v is not None else default

    common: dict[str, Any] = dict(
        chat_template=meta.get("tokenizer.chat_template"), name=p.name, token_strip=strip
    )
    if kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok: Tokenizer = SentencePieceTokenizer(
            tokens,
            types,
            [float(x) for x in scores[: len(tokens)]],
            add_space_prefix=flag("add_space_prefix", True),
            literal_kinds=roles,
            bos_id=tid("bos", 1),
            eos_id=tid("eos", 2),
            add_bos=flag("add_bos_token", True),
            **common,
        )
        pre = "default"
    elif kind == "bert":
        lowercase = flag("normalizer.lowercase", True)
        tok = WordPieceTokenizer(
            tokens,
            types,
            unk_id=tid("unknown", 100 if len(tokens) > 100 else 0) or 0,
            lowercase=lowercase,
            strip_accents=flag("normalizer.strip_accents", lowercase),
            literal_kinds=roles,
            bos_id=tid("cls", tid("bos", 101)),  # BERT's [CLS] and [SEP] open and close
            eos_id=tid("seperator", tid("eos")),  # (sic: llama.cpp's key)
            add_bos=flag("add_bos_token", True),
            **common,
        )
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
    elif kind == "gemma4":
        tok = SentencePieceTokenizer(
            tokens,
            types,
            merges=_merge_list(meta, where),
            add_space_prefix=flag("add_space_prefix", False),
            literal_kinds=roles,
            bos_id=tid("bos"),
            eos_id=tid("eos"),
            add_bos=True,  # llama.cpp forces it for Gemma 4
            **common,
        )
        pre = "gemma4"
    else:
        pre = meta.get("tokenizer.ggml.pre") or "default"  # llama.cpp's fallback, too
        common.update(bos_id=tid("bos"), eos_id=tid("eos"))
        spec = GGUF_PRE.get(pre)
        if spec is None:
            raise ValueError(
                f"{where}: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: "
                f"{', '.join(sorted(GGUF_PRE))}"
            )
        common["add_bos"] = flag("add_bos_token", spec.add_bos)
        tok = _byte_level(tokens, roles, meta, pre, where, common)
    tok.gguf_model, tok.gguf_pre = kind, pre
    # BERT closes with [SEP] (our eos_id there), by llama.cpp's add_sep
    tok.add_eos = flag("add_sep_token", True) if kind == "bert" else flag("add_eos_token", False)
    return tok


def _byte_level(
    tokens: list[str],
    roles: dict[int, str],
    meta: dict[str, Any],
    pre: str,
    where: str,
    common: dict[str, Any],
) -> Tokenizer:
    """A byte-level BPE vocabulary ("gpt2")."""
    spec = GGUF_PRE[pre]
    # SmolLM2's one-regex form of "digits, then GPT-2" (identical pieces, faster)
    pattern: str | tuple[str, ...] = SMOLLM2 if pre == "smollm" else spec.regexes
    byte_level: dict[int, bytes] = {}
    # Ordinary tokens not written in GPT-2's byte map (Command-R's emoji): no piece of text can
    # reach them (llama.cpp merges GPT-2 characters), so they only decode, as their own text.
    plain: dict[int, bytes] = {}
    specials: dict[str, int] = {}
    added: dict[str, int] = {}
    fast = _fast_byte_table()
    for i, t in enumerate(tokens):
        role = roles.get(i)
        if role == "special":
            specials[t] = i
        elif role == "added":
            added[t] = i
        else:
            try:
                byte_level[i] = t.translate(fast).encode("latin-1")
            except UnicodeEncodeError:
                plain[i] = t.encode("utf-8")
    vocab = {**plain, **byte_level}  # where bytes coincide, the byte-level token wins the lookup
    text_id = {t: i for i, t in enumerate(tokens)}
    ranks = MergeRanks(_merge_list(meta, where), tokens, text_id)
    tok = Tokenizer(
        vocab,
        None,
        pattern,
        specials,
        added_tokens=added,
        special_match="longest_first",
        ignore_merges=spec.ignore_merges,
        merge_ranks=ranks,
        **common,
    )
    # llama.cpp starts a piece from the token spelling each byte, whatever its type
    enc = bytes_to_unicode()
    tok._byte_ids = [text_id.get(enc[b]) for b in range(256)]
    tok.missing_bytes = bytes(b for b in range(256) if tok._byte_ids[b] is None)
    return tok


def _merge_list(meta: dict[str, Any], where: str) -> list[str]:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{where}: BPE tokenizer without merges (tokenizer.ggml.merges)")
    return merges


@functools.lru_cache(maxsize=1)
def _fast_byte_table() -> dict[int, int]:
    """str.translate table: GPT-2's character for each byte -> that byte (as a Latin-1 char);
    every other character below U+0100 -> U+10FFFF, so that encoding to Latin-1 fails on it."""
    table = {ord(c): b for c, b in byte_decoder().items()}
    for x in range(256):
        table.setdefault(x, 0x10FFFF)
    return table


_KEYS = (
    "general.name",
    "general.architecture",
    "tokenizer.chat_template",
)


def _read_gguf_tokenizer(path: str) -> dict[str, Any]:
    from llmlib.gguf_file import GGUFFormatError, read_gguf_file

    try:
        meta = read_gguf_file(path).metadata
    except GGUFFormatError as e:
        raise ValueError(f"{path!r}: not a readable GGUF file ({e})") from None
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.") or k in _KEYS}
