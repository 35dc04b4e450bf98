"""Stage 1 of inference: text -> token ids (byte-level BPE), and back.

- :func:`train_bpe` learns a tokenizer from a corpus (:mod:`llmlib.tokenizer.train`);
- :class:`Tokenizer` encodes and decodes (:mod:`llmlib.tokenizer.core`);
- :func:`load_tokenizer` reads ``tokenizer.json``, ``*.tiktoken`` and GGUF files
  (:mod:`llmlib.tokenizer.formats`); ``Tokenizer.save`` writes ``tokenizer.json``;
- :data:`PATTERNS` are the named pre-tokenizer regexes (:mod:`llmlib.tokenizer.pretokenize`).
"""
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.formats import load_tokenizer, save_tokenizer
from llmlib.tokenizer.pretokenize import PATTERNS, pretokenize
from llmlib.tokenizer.train import bytes_to_unicode, train_bpe

__all__ = ["Tokenizer", "train_bpe", "load_tokenizer", "save_tokenizer", "PATTERNS", "pretokenize",
           "bytes_to_unicode"]
