"""Writing a tokenizer as a Hugging Face ``tokenizer.json`` (what :meth:`Tokenizer.save` does).

It reads only the tokenizer's public surface (vocabulary, merges, pattern, special tokens), so it
needs no import of :mod:`llmlib.tokenizer.core`, and ``core`` can use it without an import cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmlib.tokenizer.bytelevel import bytes_to_unicode, to_str
from llmlib.tokenizer.pretokenize import to_onig


def save_tokenizer(tok: Any, path: str | os.PathLike[str]) -> None:
    """Write ``tok`` as a Hugging Face ``tokenizer.json`` (byte-level BPE).

    The pre-tokenizer is written as ``Split(regex, Isolated)`` (one per regex of a sequence)
    followed by ``ByteLevel(use_regex=False)``, so ``tokenizers`` cuts the text with the same
    regex and only then maps bytes to characters, exactly our order of work. Added tokens are
    written as non-special added tokens. The regex is rewritten where
    Oniguruma (the engine inside ``tokenizers``) would read it differently (:func:`to_onig`).
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(
            f"path: can only save tokenizer.json files (a .json path), got {str(path)!r}"
        )
    if tok.pattern is None:
        raise ValueError("this tokenizer has no pre-tokenizer regex; it cannot be saved")
    patterns = [tok.pattern] if isinstance(tok.pattern, str) else list(tok.pattern)
    enc = bytes_to_unicode()
    pairs = tok.merge_list()
    ids = dict(tok.vocab())
    # a merge may join literal tokens, or make one (llama.cpp's "</s>" in Qwen2 is a control
    # token that BPE can still spell): those are in the BPE vocabulary too
    ranks = getattr(tok, "_ranks", {})
    for a, b in pairs:
        for i in (a, b, ranks.get((a, b), (0, a))[1]):
            ids.setdefault(i, tok.id_to_bytes(i))
    vocab = {to_str(b, enc): i for i, b in sorted(ids.items())}
    # and every literal token is in it under its own text, as in Hugging Face's files
    literal = {**getattr(tok, "added_tokens", {}), **tok.special_tokens}
    for text, i in sorted(literal.items(), key=lambda kv: kv[1]):
        if i not in ids:
            vocab.setdefault(text, i)
    merges = [
        f"{to_str(tok.id_to_bytes(a), enc)} {to_str(tok.id_to_bytes(b), enc)}" for a, b in pairs
    ]
    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    ] + [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        for s, i in sorted(getattr(tok, "added_tokens", {}).items(), key=lambda kv: kv[1])
    ]
    data: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                *(
                    {
                        "type": "Split",
                        "pattern": {"Regex": to_onig(pat)},
                        "behavior": "Isolated",
                        "invert": False,
                    }
                    for pat in patterns
                ),
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": tok.ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
