"""Stage 1 of inference: text -> token ids (byte-level BPE), and back.

- :func:`train_bpe` learns a tokenizer from a corpus (:mod:`llmlib.tokenizer.train`);
- :class:`Tokenizer` encodes and decodes (:mod:`llmlib.tokenizer.core`);
- :func:`load_tokenizer` reads ``tokenizer.json``, ``*.tiktoken`` and GGUF files
  (:mod:`llmlib.tokenizer.formats`); ``Tokenizer.save`` writes ``tokenizer.json``
  (:mod:`llmlib.tokenizer.export`), both through GPT-2's byte map (:mod:`llmlib.tokenizer.bytelevel`);
- :data:`PATTERNS` are the named pre-tokenizer regexes (:mod:`llmlib.tokenizer.pretokenize`).
"""

from llmlib.tokenizer.bytelevel import bytes_to_unicode
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.export import save_tokenizer
from llmlib.tokenizer.formats import load_tokenizer
from llmlib.tokenizer.pretokenize import PATTERNS, pretokenize
from llmlib.tokenizer.train import train_bpe

__all__ = [
    "PATTERNS",
    "Tokenizer",
    "bytes_to_unicode",
    "load_tokenizer",
    "pretokenize",
    "save_tokenizer",
    "train_bpe",
]
