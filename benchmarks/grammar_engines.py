"""xgrammar against llguidance on this CPU, for the server's structured output.

For each JSON schema below, with SmolLM2's vocabulary (49,152 byte-level tokens):

* compile time: from the schema to a matcher ready for its first mask (xgrammar:
  ``compile_json_schema`` + ``GrammarMatcher``; llguidance: ``grammar_from_json_schema`` +
  ``LLMatcher``), a cold compile of each schema (no cache hit);
* mask time per token: the bitmask of allowed next tokens, computed at every position while the
  matcher consumes the tokens of a valid instance of the schema (the work a decode step adds).

Run it under ``bench-run`` (it is a timing); it writes ``results/cpu/grammar_engines.json``.
Both packages must be installed; only the one chosen is a dependency of llmlib.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMAS = {
    "flat object": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested with enum and array": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "weather": {"enum": ["sunny", "rainy", "cloudy"]},
                "temps": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
                "station": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                    "required": ["id", "active"],
                },
            },
            "required": ["city", "weather", "temps", "station"],
        },
        {
            "city": "Bath",
            "weather": "rainy",
            "temps": [11.5, 12.0, 9.25],
            "station": {"id": 4471, "active": True},
        },
    ),
    "any json object": ({"type": "object"}, {"a": [1, 2, {"b": None}], "c": "text"}),
}


def _vocab(tok) -> list[bytes]:
    return [tok.id_to_bytes(i) for i in range(tok.vocab_size)]


def measure_xgrammar(tok, eos: list[int]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(
        _vocab(tok), xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=eos
    )
    out = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?"}
    for name, (schema, instance) in SCHEMAS.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        times = []
        for t in tok.encode(json.dumps(instance)) + [eos[0]]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(t), (name, t)
        out[name] = {"compile_ms": 1e3 * compile_s, **_stats(times)}
    return out


def measure_llguidance(tok, eos: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    class Wrap:  # what llguidance.TokenizerWrapper reads
        def __init__(self) -> None:
            self.eos_token_id = eos[0]
            self.bos_token_id = None
            self.tokens = _vocab(tok)
            self.special_token_ids = sorted(tok.special_tokens.values())

        def __call__(self, s):
            return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap()))
    out = {"version": llguidance.get_version() if hasattr(llguidance, "get_version") else "?"}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        mask = lltorch.allocate_token_bitmask(1, tok.vocab_size)
        times = []
        for t in tok.encode(json.dumps(instance)) + [eos[0]]:
            t0 = time.perf_counter()
            lltorch.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), (name, t, matcher.get_error())
        out[name] = {"compile_ms": 1e3 * compile_s, **_stats(times)}
    return out


def _stats(times: list[float]) -> dict:
    ms = [1e3 * t for t in times]
    return {
        "tokens": len(ms),
        "mask_median_ms": statistics.median(ms),
        "mask_max_ms": max(ms),
        "mask_mean_ms": statistics.fmean(ms),
    }


def main() -> int:
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(fetch_model(quiet=True))
    eos = [tok.eos_id] if tok.eos_id is not None else [0]
    report = {"vocab_size": tok.vocab_size}
    for engine, fn in (("xgrammar", measure_xgrammar), ("llguidance", measure_llguidance)):
        try:
            report[engine] = fn(tok, eos)
        except ImportError as e:
            report[engine] = {"error": f"not installed: {e}"}
    for engine in ("xgrammar", "llguidance"):
        for name in SCHEMAS:
            r = report[engine].get(name)
            if r:
                print(
                    f"{engine:>10}  {name:<28} compile {r['compile_ms']:8.2f} ms   mask/token "
                    f"median {r['mask_median_ms']:.3f} ms  max {r['mask_max_ms']:.3f} ms"
                )
    path = Path(__file__).resolve().parents[1] / "results" / "cpu" / "grammar_engines.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
