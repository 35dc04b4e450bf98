"""Tokenizer files: Hugging Face ``tokenizer.json``, tiktoken ``*.tiktoken`` rank files, GGUF.

All three store the same thing (a list of byte strings with ids, and how to merge them) in
different clothes:

- ``tokenizer.json`` and GGUF write each token's bytes as text through GPT-2's byte-to-character
  map (:func:`~llmlib.tokenizer.bytelevel.bytes_to_unicode`: a space is ``Ġ``, a newline ``Ċ``) and
  list the merges explicitly, ``"Ġ t"``, in rank order;
- a ``.tiktoken`` file lists ``base64(token bytes) rank`` and no merges: the rank of a pair is
  the rank of the token it would make, whichever way it is split.

The pre-tokenizer regex lives elsewhere in each: a ``Split`` pre-tokenizer in the JSON, a
pre-tokenizer *name* (``tokenizer.ggml.pre``) in GGUF, nothing at all in ``.tiktoken`` (it is
in tiktoken's source code, so known files are recognised by name here).

GGUF files also hold vocabularies that are not byte-level (SentencePiece's Llama 2, Gemma 4);
:mod:`llmlib.tokenizer.gguf_vocab` reads every kind llama.cpp's tokenizer tests cover.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

from llmlib.tokenizer.bytelevel import byte_decoder, to_bytes
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.gguf_pre import GGUF_PRE
from llmlib.tokenizer.gguf_vocab import load_gguf
from llmlib.tokenizer.pretokenize import GPT2, GPT4, PATTERNS, SMOLLM2, from_onig

# tiktoken files carry neither pattern nor special tokens; these are tiktoken's own values.
TIKTOKEN_KNOWN: dict[str, tuple[str, dict[str, int]]] = {
    "cl100k_base": (
        GPT4,
        {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "r50k_base": (GPT2, {"<|endoftext|>": 50256}),
    "p50k_base": (GPT2, {"<|endoftext|>": 50256}),
}


# ---------------------------------------------------------------------------------- loading
def load_tokenizer(path: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
    """Load a tokenizer from ``tokenizer.json`` (or a folder holding one), ``*.tiktoken`` or ``*.gguf``.

    The format is chosen by extension, else by the file's first bytes. Keyword arguments go to
    the format's loader (``pattern=`` and ``special_tokens=`` for ``.tiktoken`` files that are
    not one of tiktoken's known encodings).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer file at {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix not in (".json", ".tiktoken", ".gguf"):
        with open(p, "rb") as f:
            head = f.read(4)
        suffix = ".gguf" if head == b"GGUF" else ".json" if head[:1] == b"{" else ""
    if suffix == ".json":
        return load_hf_json(p, **kwargs)
    if suffix == ".tiktoken":
        return load_tiktoken(p, **kwargs)
    if suffix == ".gguf":
        return load_gguf(p, **kwargs)
    raise ValueError(
        f"{str(p)!r}: unknown tokenizer file format (expected tokenizer.json, *.tiktoken or *.gguf)"
    )


def _hf_pattern(pre: Any, where: str) -> str | tuple[str, ...]:
    """The regex (or regex sequence) equivalent to a supported byte-level pre-tokenizer."""

    def bytelevel(d: dict[str, Any]) -> bool:
        if d.get("add_prefix_space"):
            raise ValueError(f"{where}: ByteLevel(add_prefix_space=True) is not supported")
        return bool(d.get("use_regex", True))

    if not isinstance(pre, dict):
        raise ValueError(
            f"{where}: pre_tokenizer missing; only byte-level BPE tokenizers are supported"
        )
    kind = pre.get("type")
    if kind == "ByteLevel" and bytelevel(pre):
        return GPT2
    if kind == "Sequence":
        items = pre.get("pretokenizers") or []
        kinds = [d.get("type") for d in items]
        if (
            len(kinds) >= 2
            and set(kinds[:-1]) == {"Split"}
            and kinds[-1] == "ByteLevel"
            and not bytelevel(items[-1])
        ):
            regexes = []
            for split in items[:-1]:
                pat = split.get("pattern", {})
                if split.get("behavior") != "Isolated" or split.get("invert") or "Regex" not in pat:
                    raise ValueError(
                        f"{where}: only Split(Regex, behavior='Isolated') is supported, got {split}"
                    )
                regexes.append(from_onig(pat["Regex"]))
            return regexes[0] if len(regexes) == 1 else tuple(regexes)
        if (
            kinds == ["Digits", "ByteLevel"]
            and items[0].get("individual_digits")
            and bytelevel(items[1])
        ):
            return SMOLLM2
    raise ValueError(f"{where}: unsupported pre_tokenizer {json.dumps(pre)[:200]}")


def load_hf_json(path: str | os.PathLike[str]) -> Tokenizer:
    """Read a Hugging Face ``tokenizer.json`` holding a byte-level BPE model.

    Also reads ``tokenizer_config.json`` beside it, if present, for BOS/EOS and the chat template.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(p)!r}: not a valid tokenizer.json ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{str(p)!r}: not a tokenizer.json (no 'model' object)")
    model = data["model"]
    if (
        model.get("type", "BPE") != "BPE"
        or "merges" not in model
        or not isinstance(model.get("vocab"), dict)
    ):
        raise ValueError(
            f"{str(p)!r}: model type {model.get('type')!r} is not supported (byte-level BPE only)"
        )
    if data.get("normalizer") is not None:
        raise ValueError(f"{str(p)!r}: tokenizers with a normalizer are not supported")
    pattern = _hf_pattern(data.get("pre_tokenizer"), str(p))

    dec = byte_decoder()
    # added tokens: special ones are matched only when allowed; non-special ones always
    listed = data.get("added_tokens") or []
    specials = {t["content"]: int(t["id"]) for t in listed if t.get("special", True)}
    added = {t["content"]: int(t["id"]) for t in listed if not t.get("special", True)}
    special_ids = {*specials.values(), *added.values()}
    vocab = {
        int(i): to_bytes(s, dec, str(p))
        for s, i in model["vocab"].items()
        if int(i) not in special_ids
    }
    ids = {s: int(i) for s, i in model["vocab"].items()}
    merges = []
    for k, m in enumerate(model["merges"]):
        left, right = m.split(" ") if isinstance(m, str) else m
        try:
            merges.append((ids[left], ids[right]))
        except KeyError:
            raise ValueError(
                f"{str(p)!r}: merges[{k}] = {m!r} names a token that is not in the vocab"
            ) from None

    bos = eos = template = None
    add_bos = False
    cfg_path = p.with_name("tokenizer_config.json")
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))

        def tid(key: str) -> int | None:
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            return {**added, **specials}.get(v) if isinstance(v, str) else None

        bos, eos = tid("bos_token"), tid("eos_token")
        template = cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None
        add_bos = bool(cfg.get("add_bos_token", False))
    return Tokenizer(
        vocab,
        merges,
        pattern,
        specials,
        added_tokens=added,
        ignore_merges=bool(model.get("ignore_merges")),
        bos_id=bos,
        eos_id=eos,
        chat_template=template,
        name=p.name,
        add_bos=add_bos,
    )


def load_tiktoken(
    path: str | os.PathLike[str],
    pattern: str | None = None,
    special_tokens: dict[str, int] | None = None,
) -> Tokenizer:
    """Read a tiktoken rank file (``base64(token) rank`` per line); ids are the ranks.

    tiktoken's own encodings (cl100k_base, r50k_base, p50k_base) are recognised by file name and
    get tiktoken's pattern and special tokens; for any other file pass ``pattern`` (default
    "gpt4") and ``special_tokens``.
    """
    p = Path(path)
    known = TIKTOKEN_KNOWN.get(p.stem)
    if pattern is None:
        pattern = known[0] if known else "gpt4"
    if special_tokens is None:
        special_tokens = dict(known[1]) if known else {}
    vocab: dict[int, bytes] = {}
    with open(p, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok_b64, rank = line.split()
                vocab[int(rank)] = base64.b64decode(tok_b64, validate=True)
            except (ValueError, binascii.Error):
                raise ValueError(
                    f"{str(p)!r} line {n}: expected 'base64-token rank', got {line[:60]!r}"
                ) from None
    if not vocab:
        raise ValueError(f"{str(p)!r}: empty tiktoken file")
    ranks = {b: i for i, b in vocab.items()}
    # every way of splitting a token into two tokens is a merge, ranked by the token it makes
    table: dict[tuple[int, int], tuple[int, int]] = {}
    for r, b in vocab.items():
        for k in range(1, len(b)):
            left, right = ranks.get(b[:k]), ranks.get(b[k:])
            if left is not None and right is not None:
                table[(left, right)] = (r, r)
    return Tokenizer(
        vocab,
        None,
        pattern,
        special_tokens,
        ignore_merges=True,
        merge_ranks=table,
        eos_id=special_tokens.get("<|endoftext|>"),
        name=p.stem,
    )


__all__ = [
    "GGUF_PRE",
    "PATTERNS",
    "load_gguf",
    "load_hf_json",
    "load_tiktoken",
    "load_tokenizer",
]
