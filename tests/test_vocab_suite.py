"""llama.cpp's own tokenizer tests, on llmlib: every ``ggml-vocab-*.gguf`` that llama.cpp's
``test-tokenizer-0`` checks, each test string encoded to exactly llama.cpp's ids.

The files ship in the PyPI source distribution of llama-cpp-python (which vendors llama.cpp);
``fetch_vocab_suite()`` takes them out once into llmlib's cache (about 60 MB), and the tests
skip where the package index cannot be reached. Below them, small tests of the pieces (the merge
loops, the literal-token rule, the regex sequences, the refusals) that need no download.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from llmlib.tokenizer import SentencePieceTokenizer, load_tokenizer
from llmlib.tokenizer.literal import split_longest_first
from llmlib.tokenizer.merge import MergeRanks, _bpe_heap, _bpe_rescan, bpe_merge, spm_merge
from llmlib.tokenizer.pretokenize import compile_sequence, split_sequence
from llmlib.tokenizer.suite import read_cases, run_vocab, vocab_files, vocab_name

# llama.cpp's test-tokenizer-0 list (tests/CMakeLists.txt of the vendored llama.cpp)
VOCABS = [
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]


@pytest.fixture(scope="session")
def suite_dir() -> Path:
    from llmlib.checkpoints.fetch import FetchError, fetch_vocab_suite

    try:
        return fetch_vocab_suite(quiet=True)
    except FetchError as e:
        pytest.skip(f"llama.cpp's vocabulary tests could not be fetched (package index?): {e}")


def test_the_suite_is_these_vocabularies(suite_dir: Path) -> None:
    """Every vocabulary with tests is one of ours (a new one in a new llama.cpp would show)."""
    assert sorted(vocab_name(p) for p in vocab_files(suite_dir)) == VOCABS


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_exact(suite_dir: Path, name: str) -> None:
    """Every test string gives llama.cpp's ids, and decodes back to itself."""
    r = run_vocab(suite_dir / f"ggml-vocab-{name}.gguf", keep_tokenizer=True)
    assert r.error is None, r.error
    shown = "\n".join(f"{t!r}: expected {e}, got {g}" for t, e, g in r.failures[:5])
    assert r.exact == r.strings > 0, f"{r.strings - r.exact} strings differ:\n{shown}"
    tok = r.tokenizer
    assert tok is not None
    cases = read_cases(*(suite_dir / f"ggml-vocab-{name}.gguf.{x}" for x in ("inp", "out")))
    if name == "bert-bge":
        # WordPiece cannot round-trip by design: it lowercases, drops accents, control
        # characters and the spacing around punctuation, and a word no token covers becomes
        # [UNK]. What comes back is the normalized text, words joined by one space.
        from llmlib.tokenizer.wpm import words

        for text in cases:
            ids = tok.encode(text, disallowed_special=())
            if tok.unk_id not in ids:
                assert tok.decode(ids) == " ".join(words(text)), text
        return
    bad = [t for t in cases if tok.decode(tok.encode(t, disallowed_special=())) != t]
    assert bad == [], f"{len(bad)} strings do not round-trip: {bad[:3]}"


def test_sentencepiece_cuts_change_nothing(suite_dir: Path) -> None:
    """Cutting a fragment where no token has the two characters side by side (so the cache
    can keep words) gives what SentencePiece gives on the whole fragment."""
    tok = load_tokenizer(suite_dir / "ggml-vocab-llama-spm.gguf")
    assert isinstance(tok, SentencePieceTokenizer)
    rng = random.Random(0)
    alphabet = "ab c\n\t  éü中😀▁<0x0A>.,!'-_"
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        whole = (" " + s).replace(" ", "\u2581")
        expect = tok._spell(spm_merge(whole, tok._text_id, tok._scores))  # type: ignore[arg-type]
        assert tok.encode(s, disallowed_special=()) == expect, s
        if "\u2581" not in s:  # a ▁ in the text reads as a space: SentencePiece's own sign
            assert tok.decode(expect) == s


# ---------------------------------------------------------------------------------- the pieces
def test_bpe_heap_is_the_rescanning_loop() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n_sym = rng.randint(2, 6)
        ranks = {}
        nxt = n_sym
        for r in range(rng.randint(0, 12)):
            pair = (rng.randrange(nxt), rng.randrange(nxt))
            ranks.setdefault(pair, (r, nxt))
            nxt += 1
        ids = [rng.randrange(n_sym) for _ in range(rng.randint(0, 60))]
        expect = _bpe_rescan(list(ids), ranks.get, None) if ids else []
        assert bpe_merge(ids, ranks) == expect
        if len(ids) > 1:
            assert _bpe_heap(ids, ranks.get, None) == expect


def test_lazy_merge_ranks_are_the_table() -> None:
    texts = ["a", "b", "ab", "abb", "c"]
    text_id = {t: i for i, t in enumerate(texts)}
    lazy = MergeRanks(["a b", "ab b", "a b"], texts, text_id)
    assert lazy.get((0, 1)) == (0, 2) and lazy.get((2, 1)) == (1, 3) and lazy.get((1, 0)) is None
    assert sorted(lazy.items()) == [((0, 1), (0, 2)), ((2, 1), (1, 3))] and len(lazy) == 2
    assert bpe_merge([0, 1, 1, 4], lazy) == [3, 4]
    # Tokens with spaces: llama.cpp splits "x y c" after the first character, as x + "y c";
    # the pair "x y" + c is not that merge (looking "x y" + " " + "c" up would say it is).
    texts = ["x", "y c", "xy c", "x y", "c", "x yc"]
    eager = MergeRanks(["x y c"], texts, {t: i for i, t in enumerate(texts)})
    assert eager.get((0, 1)) == (0, 2) and eager.get((3, 4)) is None


def _spm_reference(text: str, vocab: dict[str, int], scores: list[float]) -> list[str]:
    """SentencePiece's rule, the slow way: merge the best-scoring adjacent pair, leftmost first."""
    pieces = list(text)
    while True:
        best = None
        for i in range(len(pieces) - 1):
            t = vocab.get(pieces[i] + pieces[i + 1])
            if t is not None and (best is None or scores[t] > best[0]):
                best = (scores[t], i)
        if best is None:
            return pieces
        i = best[1]
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]


def test_spm_merge_is_the_slow_rule() -> None:
    rng = random.Random(2)
    chars = "abc▁"
    for _ in range(200):
        vocab: dict[str, int] = {}
        for _ in range(rng.randint(0, 25)):
            vocab.setdefault(
                "".join(rng.choice(chars) for _ in range(rng.randint(2, 4))), len(vocab)
            )
        scores = [float(rng.randint(-5, 5)) for _ in vocab]
        text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 50)))
        assert spm_merge(text, vocab, scores) == _spm_reference(text, vocab, scores), text


def _toy_spm(**kwargs: object) -> SentencePieceTokenizer:
    tokens = ["<unk>", "<s>", "</s>", "<|u|>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [2, 3, 3, 4] + [6] * 256
    words = ["▁", "a", "b", "▁a", "ab", "▁ab", "▁b"]
    scores = [0.0] * len(tokens) + [-1.0, -2.0, -2.0, -3.0, -1.5, -0.5, -4.0]
    return SentencePieceTokenizer(tokens + words, kinds + [1] * len(words), scores, **kwargs)


def test_sentencepiece_space_prefix_bytes_and_literals() -> None:
    tok = _toy_spm()
    ids = {t: tok.token_to_id(t) for t in ("▁ab", "▁", "▁a", "<s>", "<|u|>", "<0xC3>", "<0xA9>")}
    assert tok.encode("ab") == [ids["▁ab"]]  # "▁ab" (the prefix space, then the best merge)
    assert tok.encode("é") == [ids["▁"], ids["<0xC3>"], ids["<0xA9>"]]  # byte fallback
    # a user-defined token is always cut out, and the text after it gets the space again
    assert tok.encode("a<|u|>ab") == [ids["▁a"], ids["<|u|>"], ids["▁ab"]]
    assert tok.encode("<s>ab", allowed_special="all") == [ids["<s>"], ids["▁ab"]]
    for s in ["ab", " ab", "a b", "é", "a<|u|>ab", "  "]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode("<s>ab", allowed_special="all")) == "<s>ab"
    assert tok.id_to_bytes(ids["▁ab"]) == b" ab"  # in a stream, the space is there
    assert tok.encode("") == []
    plain = _toy_spm(add_space_prefix=False)
    assert plain.encode("ab") == [plain.token_to_id("ab")]
    strip = _toy_spm(token_strip={3: (False, True)})  # Phi-3's rstrip
    assert strip.encode("a<|u|>  ab") == strip.encode("a<|u|>ab")


def test_longest_first_is_llamas_rule() -> None:
    table = {"ab": 1, "bcd": 2}
    assert split_longest_first("abcd", table, {}) == ["a", 2]
    assert split_longest_first("ab ab", {"ab": 1}, {1: (False, True)}) == [1, 1]
    assert split_longest_first("x  ab", {"ab": 1}, {1: (True, False)}) == ["x", 1]


def test_regex_sequence_keeps_the_gaps() -> None:
    rules = compile_sequence((r"\p{N}", r"[a-z]+"))
    assert split_sequence("ab12 cd!", rules) == ["ab", "1", "2", " ", "cd", "!"]
    # a regex without Unicode classes does not see non-ASCII spaces as its literal characters
    cjk = compile_sequence((r"[\u3000-\u3002]+",))
    assert split_sequence("a\u3000\u3001b", cjk) == ["a\u3000", "\u3001", "b"]


def _write_gguf(path: Path, model: str, pre: str | None) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_unknown_kinds_are_refused_by_name(tmp_path: Path) -> None:
    ok = load_tokenizer(_write_gguf(tmp_path / "ok.gguf", "gpt2", "qwen2"))
    assert ok.encode("ab") == [2] and (ok.gguf_model, ok.gguf_pre) == ("gpt2", "qwen2")
    with pytest.raises(ValueError, match="'no-such-pre'"):
        load_tokenizer(_write_gguf(tmp_path / "pre.gguf", "gpt2", "no-such-pre"))
    with pytest.raises(ValueError, match="'t5'.*not supported"):
        load_tokenizer(_write_gguf(tmp_path / "t5.gguf", "t5", None))
    with pytest.raises(ValueError, match="'rwkv'.*not supported"):
        load_tokenizer(_write_gguf(tmp_path / "rwkv.gguf", "rwkv", None))
