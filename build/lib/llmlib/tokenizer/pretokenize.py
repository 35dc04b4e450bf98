"""Pre-tokenization: cut text into pieces with a regular expression before BPE sees it.

BPE never merges across a piece boundary, so the pattern decides what a token *can* be: with
the GPT-2 pattern a token never spans a letter and a digit, never glues two words together, and
keeps a word's leading space (``" the"`` is one piece). Every modern byte-level tokenizer is
"BPE + one of these patterns"; they differ mostly in how they treat digits, case and newlines.

The patterns use the third-party ``regex`` module (Unicode classes like ``\\p{L}`` and possessive
quantifiers), the same dialect tiktoken and llama.cpp use.
"""

from __future__ import annotations

import functools

import regex

# GPT-2 (2019), also what Hugging Face's ByteLevel(use_regex=True) pre-tokenizer applies.
GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# cl100k_base (GPT-3.5/GPT-4), exactly as tiktoken ships it: case-insensitive contractions,
# a word may start with one punctuation mark, numbers in groups of at most three digits,
# newlines kept apart from other whitespace.
GPT4 = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Llama 3: the cl100k idea written without possessive quantifiers (as in Meta's tokenizer.json).
LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# SmolLM2: Hugging Face's pre-tokenizer is Sequence[Digits(individual_digits=True), ByteLevel],
# i.e. every digit is cut out on its own *first*, then the GPT-2 pattern runs on the text between
# digits. Written as one regex that gives the same pieces:
#  * a digit is always a piece by itself (``\p{N}``), never with a leading space;
#  * a run of whitespace right before a digit is the end of a segment, so it stays whole
#    (GPT-2's ``\s+(?!\S)`` would give its last space away to the next piece; here the digit
#    counts as "end of text" for the lookahead, hence ``(?![^\s\p{N}])``).
SMOLLM2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

PATTERNS: dict[str, str] = {
    "gpt2": GPT2,
    "gpt4": GPT4,
    "cl100k": GPT4,
    "llama3": LLAMA3,
    "smollm2": SMOLLM2,
}


def resolve_pattern(pattern: str) -> str:
    """A pattern name from :data:`PATTERNS` or a regex string -> the regex string."""
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(
            f"pattern must be a non-empty str (a name in {sorted(PATTERNS)} or a regex), "
            f"got {pattern!r}"
        )
    return PATTERNS.get(pattern, pattern)


def pattern_name(regex_str: str) -> str | None:
    """The name of a known pattern string, or None if it is a custom regex."""
    for name, pat in PATTERNS.items():
        if pat == regex_str:
            return name
    return None


# Hugging Face ``tokenizers`` runs patterns with Oniguruma in Ruby syntax, where ``X{1,3}+``
# is not possessive but means "(X{1,3}) one or more times" -- it would glue "1814" back into one
# piece. An atomic group says the same thing in both dialects.
_POSSESSIVE_INTERVAL = regex.compile(
    r"(\\p\{\w+\}|\\[a-zA-Z]|\.|\[(?:\\.|[^\]\\])*\])(\{\d+(?:,\d*)?\})\+"
)


def to_onig(pattern: str) -> str:
    """Rewrite a pattern so Oniguruma (``tokenizers``) reads it as ``regex`` does."""
    return _POSSESSIVE_INTERVAL.sub(
        lambda m: f"(?>{m.group(1)}{m.group(2)})", resolve_pattern(pattern)
    )


def from_onig(pattern: str) -> str:
    """Inverse of :func:`to_onig` for the named patterns (so a saved file reloads as ``"gpt4"``)."""
    for pat in PATTERNS.values():
        if to_onig(pat) == pattern:
            return pat
    return pattern


@functools.lru_cache(maxsize=32)
def compile_pattern(pattern: str) -> regex.Pattern[str]:
    """Compile (once) a pattern name or regex string; a bad regex is a ValueError."""
    pat = resolve_pattern(pattern)
    try:
        return regex.compile(pat)
    except regex.error as e:
        raise ValueError(f"pattern is not a valid regex: {e}") from None


def pretokenize(text: str, pattern: str = "gpt4") -> list[str]:
    """Split ``text`` into the pieces BPE works on independently."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    return compile_pattern(pattern).findall(text)
