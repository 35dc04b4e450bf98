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


def pattern_name(regex_str: str | tuple[str, ...] | None) -> str | None:
    """The name of a known pattern string, or None if it is a custom regex (or a sequence)."""
    if not isinstance(regex_str, str):
        return None
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


# An escape \UXXXXXXXX (a character past U+FFFF) is ``regex``'s, not Oniguruma's, which
# writes \x{XXXXX} (and ``regex`` does not read that). An even run of backslashes before it is
# escaped backslashes, not the escape.
_WIDE_ESCAPE = regex.compile(r"(?<!\\)((?:\\\\)*)\\U([0-9a-fA-F]{8})")
_ONIG_WIDE = regex.compile(r"(?<!\\)((?:\\\\)*)\\x\{([0-9a-fA-F]{1,8})\}")


def to_onig(pattern: str) -> str:
    """Rewrite a pattern so Oniguruma (``tokenizers``) reads it as ``regex`` does."""
    pat = _POSSESSIVE_INTERVAL.sub(
        lambda m: f"(?>{m.group(1)}{m.group(2)})", resolve_pattern(pattern)
    )
    return _WIDE_ESCAPE.sub(lambda m: f"{m.group(1)}\\x{{{int(m.group(2), 16):x}}}", pat)


def from_onig(pattern: str) -> str:
    """Inverse of :func:`to_onig` (so a saved file reloads as ``"gpt4"``, say)."""
    for pat in PATTERNS.values():
        if to_onig(pat) == pattern:
            return pat
    return _ONIG_WIDE.sub(lambda m: f"{m.group(1)}\\U{int(m.group(2), 16):08x}", pattern)


@functools.lru_cache(maxsize=32)
def compile_pattern(pattern: str) -> regex.Pattern[str]:
    """Compile (once) a pattern name or regex string; a bad regex is a ValueError."""
    pat = resolve_pattern(pattern)
    try:
        return regex.compile(pat)
    except regex.error as e:
        raise ValueError(f"pattern is not a valid regex: {e}") from None


def pretokenize(text: str, pattern: str | tuple[str, ...] = "gpt4") -> list[str]:
    """Split ``text`` into the pieces BPE works on independently (``pattern``: a name, a regex,
    or a tuple of regexes applied in turn, see :func:`split_sequence`)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if isinstance(pattern, tuple):
        return split_sequence(text, compile_sequence(pattern))
    return compile_pattern(pattern).findall(text)


# ------------------------------------------------------------------ regex sequences
# A pre-tokenizer may be a *sequence* of regexes (llama.cpp's, and Hugging Face's Sequence of
# Split(behavior="Isolated")): each regex cuts every piece so far into its matches and the text
# between them, and nothing is dropped. llama.cpp runs a regex that has no Unicode class
# (``\p{..}``) on the text with every non-ASCII space replaced by U+000B ("wide" below), so a
# literal range like ``\u3000-\u3002`` never takes an ideographic space; so do we.
_WIDE_SPACES = {c: 0x0B for c in range(0x80, 0x3001) if regex.match(r"\s", chr(c)) is not None}


@functools.lru_cache(maxsize=64)
def compile_sequence(regexes: tuple[str, ...]) -> tuple[tuple[regex.Pattern[str], bool], ...]:
    """Compile a regex sequence for :func:`split_sequence`: (splitter, wide) per regex."""
    out = []
    for r in regexes:
        try:
            rx = regex.compile("(" + resolve_pattern(r) + ")")
        except regex.error as e:
            raise ValueError(f"pattern {r!r} is not a valid regex: {e}") from None
        if rx.groups != 1:
            raise ValueError(f"pattern {r!r}: use non-capturing groups (?:...) in a sequence")
        out.append((rx, "\\p{" not in r))
    return tuple(out)


def split_sequence(text: str, rules: tuple[tuple[regex.Pattern[str], bool], ...]) -> list[str]:
    """Cut ``text`` by each compiled regex in turn, keeping matches and the text between them."""
    pieces = [text]
    for rx, wide in rules:
        out: list[str] = []
        for p in pieces:
            if wide and not p.isascii():
                q = p.translate(_WIDE_SPACES)
                if q != p:  # match on the translated text, cut the original at the same places
                    k = 0
                    for s in rx.split(q):
                        if s:
                            out.append(p[k : k + len(s)])
                            k += len(s)
                    continue
            out.extend(s for s in rx.split(p) if s)
        pieces = out
    return pieces
