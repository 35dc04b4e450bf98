"""llmlib's BPE trainer and encoder against Hugging Face ``tokenizers`` and by properties."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers is imported

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmlib
from llmlib.tokenizer import PATTERNS, Tokenizer, load_tokenizer, pretokenize, train_bpe

tokenizers = pytest.importorskip("tokenizers")

CORPUS = Path(__file__).resolve().parents[1] / "data" / "austen.txt"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def corpus() -> str:
    text = CORPUS.read_text(encoding="utf-8")
    return text[1_000_000:1_200_000]  # 200 KB from the middle, to keep the suite fast


@pytest.fixture(scope="module")
def trained(corpus: str) -> Tokenizer:
    return train_bpe(corpus, 1024, pattern="gpt4", special_tokens=SPECIALS, progress=False)


@pytest.fixture(scope="module")
def per_pattern(corpus: str, tmp_path_factory) -> dict:
    """For each named pattern: (our tokenizer, the same saved and loaded by tokenizers)."""
    out = {}
    d = tmp_path_factory.mktemp("bpe")
    for name in ("gpt2", "gpt4", "llama3", "smollm2"):
        tok = train_bpe(
            corpus[:60_000] + "12 345 6789 2024 1,000,000",
            700,
            pattern=name,
            special_tokens=SPECIALS,
            progress=False,
        )
        path = d / f"{name}.json"
        tok.save(path)
        out[name] = (tok, tokenizers.Tokenizer.from_file(str(path)))
    return out


# ---- random text that stresses pre-tokenization: scripts, emoji, whitespace, digits, controls
FRAGMENTS = [
    "the",
    " The",
    "Elizabeth",
    "don't",
    "'s",
    "'LL",
    "I'M",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u00a0",
    "\u3000",
    "\u2028",
    "0",
    "7",
    "42",
    "2024",
    "3.14159",
    "1,000,000",
    "٣٤",
    "１２",
    "Ⅻ",
    "½",
    "ﬁ",
    "straße",
    "Привет",
    "мир",
    "你好世界",
    "日本語のテキスト",
    "हिन्दी",
    "مرحبا",
    "שלום",
    "🤖",
    "👩‍👩‍👧",
    "🇫🇷",
    "é",
    "e\u0301",
    "\x00",
    "\x04",
    "\x1b[0m",
    "\x7f",
    "\x85",
    "...",
    "?!",
    "—",
    "«»",
    "def f(x):",
    "    return x**2",
    "<|",
    "|>",
    "<|endoftext",
    "\ufeff",
    "\U0001f600\U0001f600",
]
# Code points unassigned in Python's Unicode tables are left out: the regex engines disagree on
# them only because they ship different Unicode versions (a newer `regex` calls some letters).
chars = st.characters(exclude_categories=("Cn", "Cs"))
texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
    st.text(chars, max_size=60),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(chars, max_size=5)), max_size=20).map(
        "".join
    ),
)
HYP = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------------------- training
def test_train_shapes_and_ids(trained: Tokenizer):
    assert trained.vocab_size == 1024
    assert len(trained.merge_list()) == 1024 - 256 - len(SPECIALS)
    assert [trained.id_to_bytes(i) for i in range(256)] == [bytes([b]) for b in range(256)]
    assert trained.special_tokens == {s: 1021 + k for k, s in enumerate(SPECIALS)}
    assert trained.eos_id == 1021
    # every merged token is the concatenation of its pair, ids in merge order
    for k, (a, b) in enumerate(trained.merge_list()):
        assert trained.id_to_bytes(256 + k) == trained.id_to_bytes(a) + trained.id_to_bytes(b)
        assert a < 256 + k and b < 256 + k


def test_merges_equal_tokenizers_trainer(corpus: str):
    """Same counts and the documented tie-break: merge for merge what tokenizers' BpeTrainer learns."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    ours = train_bpe(corpus, 1024, pattern="gpt4", special_tokens=["<|endoftext|>"], progress=False)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(PATTERNS["llama3"]), behavior="isolated"
            ),  # same pieces on this text
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    hf.train_from_iterator([corpus], trainer=trainer)
    hf_merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in json.loads(hf.to_str())["model"]["merges"]
    ]
    enc = llmlib.tokenizer.bytes_to_unicode()
    ours_merges = [
        ("".join(enc[c] for c in ours.id_to_bytes(a)), "".join(enc[c] for c in ours.id_to_bytes(b)))
        for a, b in ours.merge_list()
    ]
    assert ours_merges == hf_merges


def test_first_merges_are_frequent_english_pairs(trained: Tokenizer):
    first = [trained.id_to_bytes(256 + k) for k in range(10)]
    assert b" t" in first and b"he" in first


def test_min_frequency_stops_early():
    tok = train_bpe("ab ab ab cd", 300, min_frequency=2, progress=False)
    learned = [tok.id_to_bytes(256 + k) for k in range(len(tok.merge_list()))]
    assert learned == [b"ab", b" ab"]  # "cd" and " " + "cd" occur once: not merged
    assert tok.vocab_size == 258


def test_iterable_input_equals_string(corpus: str):
    lines = corpus[:30_000].splitlines(keepends=True)
    a = train_bpe(corpus[:30_000], 400, progress=False)
    b = train_bpe(iter(lines), 400, progress=False)
    # splitting at line ends changes only pieces that would span a newline; merges stay close
    assert a.merge_list()[:50] == b.merge_list()[:50]


def test_deterministic(corpus: str):
    a = train_bpe(corpus[:50_000], 500, progress=False).merge_list()
    b = train_bpe(corpus[:50_000], 500, progress=False).merge_list()
    assert a == b


# ------------------------------------------------------------------ identity with tokenizers
@pytest.mark.parametrize("name", ["gpt2", "gpt4", "llama3", "smollm2"])
def test_saved_json_encodes_identically_on_corpus(per_pattern, corpus: str, name: str):
    ours, hf = per_pattern[name]
    chunk = corpus[100_000:200_000]
    assert ours.encode(chunk) == hf.encode(chunk, add_special_tokens=False).ids


@HYP
@given(text=texts)
def test_saved_json_encodes_identically_random(per_pattern, text: str):
    for name, (ours, hf) in per_pattern.items():
        assert (
            ours.encode(text, allowed_special="all")
            == hf.encode(text, add_special_tokens=False).ids
        ), name


@HYP
@given(text=texts)
def test_patterns_split_like_tokenizers(text: str):
    """The regexes themselves, against tokenizers' own pre-tokenizers (GPT-2 and SmolLM2's)."""
    from tokenizers import pre_tokenizers as pt

    enc = llmlib.tokenizer.bytes_to_unicode()

    def bl(pieces):
        return ["".join(enc[b] for b in p.encode("utf-8")) for p in pieces]

    gpt2 = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    smol = pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    assert bl(pretokenize(text, "gpt2")) == [p for p, _ in gpt2.pre_tokenize_str(text)]
    assert bl(pretokenize(text, "smollm2")) == [p for p, _ in smol.pre_tokenize_str(text)]


def test_json_round_trip_through_llmlib(per_pattern, tmp_path, corpus: str):
    ours, _ = per_pattern["gpt4"]
    ours.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)  # a folder with tokenizer.json
    assert again.pattern_name == "gpt4" and again.special_tokens == ours.special_tokens
    text = corpus[:20_000] + "<|im_start|>user\nhi 1234<|im_end|>"
    assert again.encode(text, allowed_special="all") == ours.encode(text, allowed_special="all")


# ------------------------------------------------------------------------------ round trips
@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_decode_encode_round_trip(trained: Tokenizer, text: str):
    assert trained.decode(trained.encode(text, disallowed_special=())) == text


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=80))
def test_bytes_round_trip(trained: Tokenizer, data: bytes):
    ids = trained.encode_bytes(data)
    assert trained.decode_bytes(ids) == data
    # and token by token: each id's bytes, concatenated, are exactly the input
    assert b"".join(trained.id_to_bytes(i) for i in ids) == data


def test_decode_replaces_invalid_utf8(trained: Tokenizer):
    ids = trained.encode("é")  # two bytes, possibly one token
    half = trained.encode_bytes(b"\xc3")
    assert trained.decode(half) == "\ufffd"
    assert trained.decode_bytes(half) == b"\xc3"
    assert trained.decode(ids) == "é"


def test_cache_does_not_change_results(corpus: str):
    tok = train_bpe(corpus[:40_000], 400, progress=False)
    text = corpus[40_000:60_000]
    cold = tok.encode(text)
    assert tok._cache  # pieces were cached
    assert tok.encode(text) == cold
    tok.clear_cache()
    assert not tok._cache
    assert tok.encode(text) == cold


# ----------------------------------------------------------------------------- special tokens
def test_special_tokens_allowed_and_disallowed(trained: Tokenizer):
    text = "<|im_start|>user\nHello<|im_end|>"
    with pytest.raises(ValueError, match="not allowed"):
        trained.encode(text)
    ids = trained.encode(text, allowed_special="all")
    assert (
        ids[0] == trained.special_tokens["<|im_start|>"]
        and ids[-1] == trained.special_tokens["<|im_end|>"]
    )
    assert trained.decode(ids) == text
    # only one of them allowed: the other must still raise
    with pytest.raises(ValueError, match="<\\|im_end\\|>"):
        trained.encode(text, allowed_special={"<|im_start|>"})
    # explicitly not checked: encoded as plain text
    plain = trained.encode(text, disallowed_special=())
    assert trained.special_tokens["<|im_start|>"] not in plain and trained.decode(plain) == text
    with pytest.raises(ValueError, match="not special tokens"):
        trained.encode("x", allowed_special={"<|nope|>"})


def test_adjacent_and_partial_specials(trained: Tokenizer):
    s = "<|endoftext|><|endoftext|>x<|endoftext"
    ids = trained.encode(s, allowed_special="all")
    eot = trained.special_tokens["<|endoftext|>"]
    assert ids[:2] == [eot, eot] and ids.count(eot) == 2
    assert trained.decode(ids) == s


# -------------------------------------------------------------------------------- bad input
def test_bad_input_errors(trained: Tokenizer, tmp_path):
    with pytest.raises(TypeError, match="text must be str"):
        trained.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text must be str"):
        trained.encode(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        train_bpe(12345, 300)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"text\[1\]"):
        train_bpe(["ok", 3], 300)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe("hello", 100)
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe("hello", 257, special_tokens=["<a>", "<b>"])
    with pytest.raises(TypeError, match="vocab_size"):
        train_bpe("hello", 300.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_frequency"):
        train_bpe("hello", 300, min_frequency=0)
    with pytest.raises(ValueError, match="not in this vocabulary"):
        trained.decode([trained.vocab_size])
    with pytest.raises(ValueError, match="not in this vocabulary"):
        trained.decode([-1])
    with pytest.raises(ValueError, match="not a valid regex"):
        train_bpe("hello", 300, pattern="(unclosed")


def test_bad_files(tmp_path):
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(bad_json)
    wordpiece = tmp_path / "wp.json"
    wordpiece.write_text(
        json.dumps({"model": {"type": "WordPiece", "vocab": {}}}), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="not supported"):
        load_tokenizer(wordpiece)
    unknown = tmp_path / "vocab.bin"
    unknown.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="unknown tokenizer file format"):
        load_tokenizer(unknown)
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ValueError, match="GGUF"):
        load_tokenizer(fake_gguf)
    bad_tt = tmp_path / "x.tiktoken"
    bad_tt.write_text("IQ== 0\nthis is not base64!! 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        load_tokenizer(bad_tt)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        load_tokenizer(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=".json"):
        train_bpe("hello there", 260, progress=False).save(tmp_path / "tok.txt")


def test_public_names():
    assert llmlib.train_bpe is train_bpe and llmlib.load_tokenizer is load_tokenizer
    assert llmlib.Tokenizer is Tokenizer


@pytest.mark.slow
def test_full_corpus_vocab_4096_identical_to_tokenizers(tmp_path):
    """The benchmark's setting, checked: vocab 4,096 on all of Austen, encoded in both libraries."""
    text = CORPUS.read_text(encoding="utf-8")
    tok = train_bpe(text, 4096, pattern="gpt4", special_tokens=["<|endoftext|>"], progress=False)
    tok.save(tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    paragraphs = text.split("\n\n")
    ours = [tok.encode(p) for p in paragraphs]
    theirs = [e.ids for e in hf.encode_batch(paragraphs, add_special_tokens=False)]
    assert ours == theirs


def test_bench_bpe_runs_small(tmp_path, corpus: str, capsys):
    """`llmlib bench bpe` end to end on a small corpus: figures present, libraries agree."""
    from llmlib.bench import bpe

    small = tmp_path / "small.txt"
    small.write_text(corpus[:30_000], encoding="utf-8")
    assert (
        bpe.main(["--corpus", str(small), "--vocab-size", "400", "--repeats", "1", "--json"]) == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["train"]["same_merges"] is True and res["train"]["ratio"] > 0
    for row in res["encode"].values():
        assert row["identical"] is True and row["llmlib_mb_s"] > 0


@settings(max_examples=100, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(
            [
                "the",
                " the",
                " cat",
                "cat",
                "at",
                " hat",
                "aaaa",
                "abab",
                " ",
                "  ",
                "\n",
                "ü",
                "日本",
                "🤖",
                "12",
                "!!",
                "ab",
                "ba",
                "aab",
                "abb",
            ]
        ),
        min_size=1,
        max_size=60,
    ),
    vocab=st.integers(257, 330),
    min_frequency=st.integers(1, 3),
    pattern=st.sampled_from(["gpt2", "gpt4", "smollm2"]),
)
def test_merges_equal_tokenizers_trainer_random(parts, vocab, min_frequency, pattern):
    """Tiny corpora are full of ties: the documented tie-break must match tokenizers' exactly."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from llmlib.tokenizer.pretokenize import to_onig

    text = "".join(parts)
    ours = train_bpe(text, vocab, pattern=pattern, min_frequency=min_frequency, progress=False)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(to_onig(pattern)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.train_from_iterator(
        [text],
        trainer=trainers.BpeTrainer(
            vocab_size=vocab,
            min_frequency=min_frequency,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    enc = llmlib.tokenizer.bytes_to_unicode()
    hf_merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in json.loads(hf.to_str())["model"]["merges"]
    ]
    ours_merges = [
        ("".join(enc[c] for c in ours.id_to_bytes(a)), "".join(enc[c] for c in ours.id_to_bytes(b)))
        for a, b in ours.merge_list()
    ]
    assert ours_merges == hf_merges
