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

    The pre-tokenizer is written as ``Split(regex, Isolated)`` followed by
    ``ByteLevel(use_regex=False)``, so ``tokenizers`` cuts the text with the same regex and
    only then maps bytes to characters, exactly our order of work. The regex is rewritten where
    Oniguruma (the engine inside ``tokenizers``) would read it differently (:func:`to_onig`).
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(
            f"path: can only save tokenizer.json files (a .json path), got {str(path)!r}"
        )
    enc = bytes_to_unicode()
    vocab = {to_str(b, enc): i for i, b in sorted(tok.vocab().items())}
    merges = [
        f"{to_str(tok.id_to_bytes(a), enc)} {to_str(tok.id_to_bytes(b), enc)}"
        for a, b in tok.merge_list()
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
                {
                    "type": "Split",
                    "pattern": {"Regex": to_onig(tok.pattern)},
                    "behavior": "Isolated",
                    "invert": False,
                },
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
