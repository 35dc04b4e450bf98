"""Structured output: the next token restricted, step by step, to those a JSON schema allows.

A grammar engine turns a JSON schema into a matcher over the tokenizer's vocabulary. Before each
draw the matcher computes a bitmask of the tokens that can continue a document valid against the
schema (a token may carry several characters, or half of one); the sampler sets every other logit
to -inf; after the draw the matcher consumes the token. When the document is complete only the
end-of-sequence tokens remain allowed, so the output always parses and validates.

The engine is ``llguidance``, chosen over ``xgrammar`` by measurement on this project's CPU with
SmolLM2's 49,152-token vocabulary (``benchmarks/grammar_engines.py`` writes
``results/cpu/grammar_engines.json``): both compute a token's mask in far less time than a decode
step takes, so the mask cost does not decide it; compiling a schema, which the server does on the
request path for every new schema, took llguidance several times less than xgrammar; and
llguidance is one small wheel with no dependencies, where xgrammar pulls in triton and a TVM FFI
runtime. llguidance also reports an uncompilable schema as a message instead of raising, which is
what a server turns into a 400.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch


class SchemaError(ValueError):
    """The grammar engine cannot compile this schema (the message says why)."""


class Grammars:
    """Compiles JSON schemas for one tokenizer and end-token set, and caches the grammars.

    ``tokenizer`` is llmlib's (it needs ``id_to_bytes``, ``encode``, ``vocab_size`` and
    ``special_tokens``); ``eos_ids`` are the tokens that may end a complete document.
    """

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int] | set[int], cache_size: int = 256):
        import llguidance

        if not eos_ids:
            raise ValueError("structured output needs an end-of-sequence token to finish on")
        self.vocab_size = int(tokenizer.vocab_size)
        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Wrap(tokenizer, sorted(eos_ids))),
            eos_token=sorted(eos_ids),
        )
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the server checks schemas while the engine thread compiles

    def grammar(self, schema: dict) -> str:
        """The compiled grammar of ``schema`` (cached), or :class:`SchemaError` saying why not."""
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                key, defaults={"whitespace_flexible": False}
            )
        except (ValueError, TypeError) as e:
            raise SchemaError(f"the JSON schema cannot be compiled: {e}") from e
        err = self._llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if err and not err.startswith("WARNING"):
            raise SchemaError(f"the JSON schema cannot be compiled: {err}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, schema: dict) -> Matcher:
        m = self._llg.LLMatcher(self._tokenizer, self.grammar(schema), log_level=0)
        return Matcher(m, self.vocab_size)


class Matcher:
    """One choice's position in its grammar: the allowed next tokens, and the tokens taken."""

    def __init__(self, m: Any, vocab: int):
        self._m, self.vocab = m, vocab

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into ``bitmask[row]`` (int32, 32 tokens a word)."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def consume(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar refused it."""
        return bool(self._m.consume_token(int(token))) and not self._m.is_error()

    @property
    def done(self) -> bool:
        """The document is complete and an end token was taken (or the matcher failed)."""
        return self._m.is_stopped() or self._m.is_error()


def allowed(matchers: list[Matcher], vocab: int, device: torch.device) -> torch.Tensor:
    """The bool mask [len(matchers), vocab] of tokens each matcher allows (ids past the
    tokenizer's vocabulary, such as a model's padding rows, are never allowed)."""
    words = (vocab + 31) // 32
    bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(bits, i)
    shifts = torch.arange(32, dtype=torch.int32)
    mask = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(matchers), words * 32)
    return mask[:, :vocab].to(device)


class _Wrap:
    """llmlib's tokenizer as llguidance's ``TokenizerWrapper`` reads one."""

    def __init__(self, tok: Any, eos: list[int]):
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(tok, "bos_id", None)
        self.tokens = [tok.id_to_bytes(i) or b"" for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(getattr(tok, "special_tokens", {}).values())
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(self._tok.encode(s, disallowed_special=()))
