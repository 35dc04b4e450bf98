"""llama.cpp's pre-tokenizers, by the name a GGUF file gives in ``tokenizer.ggml.pre``.

A GGUF file does not carry its pre-tokenizer's regex, only a name; llama.cpp's
``src/llama-vocab.cpp`` maps each name to a *sequence* of regexes. Each regex of the sequence cuts
every piece made so far into its matches *and* the stretches between them (nothing is dropped),
and the next regex cuts those pieces again. So DeepSeek's coder tokenizer first isolates each
newline, then runs of letters, then runs of punctuation, then CJK runs, then single digits.

The regexes below are llama.cpp's, in the ``regex`` module's dialect, with two details that make
them behave exactly as llama.cpp runs them:

- where llama.cpp writes ``(?i:'s|...)`` it matches the contractions with explicit classes
  (``'[sS]``): ``(?i)`` in ``regex`` would also take ``'ſ`` (a long s folds to ``s``);
- a regex without a Unicode class (``\\p{..}``) runs in llama.cpp on the text with every
  non-ASCII space replaced by U+000B, so a literal range such as DeepSeek's ``\\u3000-\\u3002``
  never takes an ideographic space; :func:`~llmlib.tokenizer.pretokenize.split_sequence` does
  the same (``wide`` below). And
  ``$`` is the end of the piece (``\\Z``), as in C++'s ECMAScript regexes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmlib.tokenizer.pretokenize import GPT2

# llama.cpp's contraction alternatives (case-insensitive by hand)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

LLAMA3_CPP = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_CPP = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5: letter runs take combining marks too
QWEN35_CPP = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# DeepSeek LLM's letters: the cased scripts (Latin, Greek, Cyrillic, Armenian, Georgian, ...)
_DEEPSEEK_LETTERS = (
    r"A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    r"\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    r"\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    r"\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    r"\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    r"\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    r"\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    r"\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    r"\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    r"\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    r"\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    r"\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    r"\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# CJK ideographs, U+0800..U+4E00 (most scripts past Cyrillic), Hangul syllables
_CJK = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

DEEPSEEK_LLM_CPP = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\Z",
    _CJK,
    r"\p{N}+",
)
DEEPSEEK_CODER_CPP = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
FALCON_CPP = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")
# digits one by one, then GPT-2's regex (StarCoder, Refact, Command-R, SmolLM, ...)
STARCODER_CPP = (r"\p{N}", GPT2)
# llama.cpp's "default": punctuation runs first, then GPT-2, numbers, groups of three digits
DEFAULT_CPP = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# Gemma 4 (SentencePiece-style BPE): only newline runs are cut out
NEWLINES = (r"[^\n]+|[\n]+",)


@dataclass(frozen=True)
class GGUFPre:
    """One llama.cpp pre-tokenizer: its regexes, and whether a piece that is already a token is
    taken whole before merging (``ignore_merges``, Llama 3's rule)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default where the file does not say


def _names(names: str, pre: GGUFPre) -> dict[str, GGUFPre]:
    return dict.fromkeys(names.split(), pre)


#: ``tokenizer.ggml.pre`` -> pre-tokenizer, for byte-level BPE files (``tokenizer.ggml.model``
#: "gpt2"). The names are llama.cpp's; each group shares one regex sequence there.
GGUF_PRE: dict[str, GGUFPre] = {
    "default": GGUFPre(DEFAULT_CPP),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        GGUFPre((LLAMA3_CPP,), ignore_merges=True, add_bos=True),
    ),
    **_names("dbrx smaug-bpe", GGUFPre((LLAMA3_CPP,))),
    "deepseek-llm": GGUFPre(DEEPSEEK_LLM_CPP),
    "deepseek-coder": GGUFPre(DEEPSEEK_CODER_CPP),
    "falcon": GGUFPre(FALCON_CPP),
    **_names(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "exaone4 mpt olmo jais trillion granite-docling jina-v1-en jina-v2-code roberta-bpe",
        GGUFPre((GPT2,)),
    ),
    **_names(
        "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
        GGUFPre(STARCODER_CPP),
    ),
    **_names(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        GGUFPre((QWEN2_CPP,)),
    ),
    "qwen35": GGUFPre((QWEN35_CPP,)),
}
