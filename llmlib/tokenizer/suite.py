"""llama.cpp's own tokenizer tests, run on llmlib's tokenizer.

llama.cpp checks its tokenizer against reference ids it keeps beside small vocabulary-only GGUF
files (``models/ggml-vocab-NAME.gguf``): ``NAME.gguf.inp`` holds test strings separated by a line
``__ggml_vocab_test__``, ``NAME.gguf.out`` one line of expected ids per string. The ids are what
``llama_tokenize(text, add_special=false, parse_special=false)`` gives: no BOS, and special-token
text treated as text; that is llmlib's ``encode(text, disallowed_special=())``.

:func:`run_suite` loads every vocabulary in a folder and compares; the book shows its table.
``llmlib.checkpoints.fetch.fetch_vocab_suite()`` fetches the files (from the PyPI source
distribution of llama-cpp-python, which vendors llama.cpp).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmlib.tokenizer.core import Tokenizer
from llmlib.tokenizer.gguf_vocab import load_gguf

SEPARATOR = "\n__ggml_vocab_test__\n"


def read_cases(inp: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, list[int]]:
    """The test strings of an ``.inp`` file and their ids from the ``.out`` file.

    Read as llama.cpp's ``test-tokenizer-0`` reads them: the ``.inp`` text is cut at every
    separator (a last piece that is empty does not count), line k of ``.out`` holds the ids of
    string k, and a string listed twice keeps its last ids.
    """
    raw = Path(inp).read_bytes().decode("utf-8")
    strings = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            strings.append(raw[pos:])
            break
        strings.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = Path(out).read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(strings):
        raise ValueError(f"{inp}: {len(strings)} test strings but {out} has {len(lines)} lines")
    return {s: [int(x) for x in line.split()] for s, line in zip(strings, lines)}


def vocab_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``ggml-vocab-*.gguf`` files in ``directory`` that have their ``.inp`` and ``.out``."""
    d = Path(directory)
    return sorted(
        p
        for p in d.glob("ggml-vocab-*.gguf")
        if p.with_name(p.name + ".inp").is_file() and p.with_name(p.name + ".out").is_file()
    )


def vocab_name(path: str | os.PathLike[str]) -> str:
    """``ggml-vocab-llama-spm.gguf`` -> ``"llama-spm"``."""
    return Path(path).name.removeprefix("ggml-vocab-").removesuffix(".gguf")


@dataclass
class VocabResult:
    """One vocabulary's result: how many test strings gave llama.cpp's ids exactly."""

    name: str
    tokenizer_type: str  # tokenizer.ggml.model ("gpt2", "llama", "gemma4", "bert")
    pre: str  # the pre-tokenizer ("default" where the file names none)
    strings: int
    exact: int
    round_trip: int  # strings with decode(encode(s)) == s
    seconds: float  # loading and encoding
    failures: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    error: str | None = None  # the vocabulary could not be loaded
    tokenizer: Tokenizer | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exact == self.strings


def run_vocab(path: str | os.PathLike[str], keep_tokenizer: bool = False) -> VocabResult:
    """Encode every test string of one vocabulary and compare with llama.cpp's ids."""
    p = Path(path)
    cases = read_cases(p.with_name(p.name + ".inp"), p.with_name(p.name + ".out"))
    t0 = time.perf_counter()
    try:
        tok = load_gguf(p)
    except ValueError as e:
        return VocabResult(vocab_name(p), "?", "?", len(cases), 0, 0, 0.0, error=str(e))
    exact = round_trip = 0
    failures = []
    for text, expected in cases.items():
        ids = tok.encode(text, disallowed_special=())
        if ids == expected:
            exact += 1
        else:
            failures.append((text, expected, ids))
        round_trip += tok.decode(ids) == text
    return VocabResult(
        vocab_name(p),
        tok.gguf_model or "?",
        tok.gguf_pre or "?",
        len(cases),
        exact,
        round_trip,
        time.perf_counter() - t0,
        failures,
        tokenizer=tok if keep_tokenizer else None,
    )


def run_suite(directory: str | os.PathLike[str]) -> list[VocabResult]:
    """:func:`run_vocab` for every vocabulary with tests in ``directory``."""
    files = vocab_files(directory)
    if not files:
        raise FileNotFoundError(f"no ggml-vocab-*.gguf with .inp and .out files in {directory}")
    return [run_vocab(p) for p in files]


def suite_table(results: list[VocabResult]) -> str:
    """The results as a plain-text table (vocabulary, type, pre-tokenizer, exact/strings)."""
    rows = [("vocabulary", "type", "pre-tokenizer", "exact", "round trip", "seconds")]
    for r in results:
        exact = f"{r.exact}/{r.strings}" if r.error is None else "refused"
        rows.append(
            (
                r.name,
                r.tokenizer_type,
                r.pre,
                exact,
                f"{r.round_trip}/{r.strings}",
                f"{r.seconds:.2f}",
            )
        )
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
