"""Stage 1 of inference: text -> token ids (byte-level BPE, SentencePiece), and back.

- :func:`train_bpe` learns a tokenizer from a corpus (:mod:`llmlib.tokenizer.train`);
- :class:`Tokenizer` encodes and decodes (:mod:`llmlib.tokenizer.core`), with the merge loops in
  :mod:`llmlib.tokenizer.merge` and literal (special and added) tokens in
  :mod:`llmlib.tokenizer.literal`;
- :func:`load_tokenizer` reads ``tokenizer.json``, ``*.tiktoken`` and GGUF files
  (:mod:`llmlib.tokenizer.formats`; GGUF vocabularies of every kind llama.cpp's tokenizer tests
  cover in :mod:`llmlib.tokenizer.gguf_vocab`, their pre-tokenizers in
  :mod:`llmlib.tokenizer.gguf_pre`, SentencePiece-style ones in :mod:`llmlib.tokenizer.spm`);
  ``Tokenizer.save`` writes ``tokenizer.json`` (:mod:`llmlib.tokenizer.export`), both through
  GPT-2's byte map (:mod:`llmlib.tokenizer.bytelevel`);
- :data:`PATTERNS` are the named pre-tokenizer regexes (:mod:`llmlib.tokenizer.pretokenize`);
- :func:`llmlib.tokenizer.suite.run_suite` checks a vocabulary against llama.cpp's own tokenizer
  tests (``ggml-vocab-*.gguf`` with their ``.inp``/``.out`` files).
"""

from llmlib.tokenizer.bytelevel import bytes_to_unicode
from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.export import save_tokenizer
from llmlib.tokenizer.formats import load_tokenizer
from llmlib.tokenizer.pretokenize import PATTERNS, pretokenize
from llmlib.tokenizer.spm import SentencePieceTokenizer
from llmlib.tokenizer.train import train_bpe

__all__ = [
    "PATTERNS",
    "SentencePieceTokenizer",
    "Tokenizer",
    "bytes_to_unicode",
    "load_tokenizer",
    "pretokenize",
    "save_tokenizer",
    "train_bpe",
]
