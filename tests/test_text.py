"""The one request-text pipeline: UTF-8 across tokens, stop strings and held-back text, the same
through the Generator, the batching engine and its streamed deltas."""

from __future__ import annotations

import pytest

import llmlib
from llmlib.config import ModelConfig
from llmlib.engine import LLM
from llmlib.generate import Generator
from llmlib.model import random_model
from llmlib.sampling import SamplingParams
from llmlib.text import TextStream, held_back

CORPUS = ("the cat sat on the mat 😀 and 日本語のテキスト. " * 20) + "emoji 🎉🎉 café naïve " * 10


@pytest.fixture(scope="module")
def pair() -> tuple[Generator, LLM, object]:
    tok = llmlib.train_bpe(CORPUS, vocab_size=330, pattern="gpt4")
    cfg = ModelConfig(
        name="tiny-text",
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=128,
    )
    model = random_model(cfg, device="cpu", seed=3, std=0.5)  # wild weights: many split characters
    return Generator(model, tok), LLM(model, tok, num_blocks=64, block_size=4), tok


def _engine_stream(llm: LLM, prompt: str, params: SamplingParams) -> tuple[str, str]:
    rid = llm.add_request(prompt, params)
    pieces, final = [], None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid:
                pieces.append(out.delta_text)
                final = out if out.finished else final
    assert final is not None
    return "".join(pieces), final.text


@pytest.mark.parametrize("prompt", ["日本", "the 😀", "café", "the cat"])
def test_generator_and_engine_agree_on_text(pair, prompt: str) -> None:
    gen, llm, tok = pair
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = gen.generate(prompt, params)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.token_ids == plain.token_ids
    assert out.text == plain.text == tok.decode(plain.token_ids)  # incremental == all at once
    assert "".join(gen.stream(prompt, params)) == plain.text
    streamed, final = _engine_stream(llm, prompt, params)
    assert streamed == final == plain.text

    # a stop string cut from the middle of the text, so it spans token boundaries
    text = plain.text
    start = next((i for i in range(3, len(text) - 3) if "\ufffd" not in text[i : i + 3]), None)
    if start is None:
        pytest.skip("no clean three characters in this text")
    stop = text[start : start + 3]
    expected = text[: text.index(stop)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    g = gen.generate(prompt, sp)
    (e,) = llm.generate([prompt], sp, use_tqdm=False)
    assert g.text == e.text == expected
    assert g.finish_reason == e.finish_reason == "stop"
    assert "".join(gen.stream(prompt, sp)) == expected
    assert _engine_stream(llm, prompt, sp) == (expected, expected)


def test_held_back_text_is_released_when_innocent() -> None:
    pieces = {1: b"ab", 2: b"<", 3: b"/x", 4: b"<", 5: b"/s>", 6: b"tail"}
    t = TextStream(pieces.__getitem__, stop=["</s>"])
    out = []
    for tok in (1, 2, 3, 4):
        assert not t.add_token(tok)
        out.append(t.delta())
    assert out == ["ab", "", "</x", ""]  # "<" might start "</s>": held until the next piece
    assert t.add_token(5)  # "</s>" complete: the text ends before it
    assert t.delta() == "" and t.text == "ab</x"
    with pytest.raises(RuntimeError):
        t.add_token(6)


def test_split_utf8_character_is_held_then_joined() -> None:
    smile = "😀".encode()
    t = TextStream({1: smile[:2], 2: smile[2:], 3: b"\xe6"}.__getitem__)
    t.add_token(1)
    assert t.delta() == ""  # half a character: nothing to show yet
    t.add_token(2)
    assert t.delta() == "😀"
    t.add_token(3)  # a dangling first byte ...
    t.close()
    assert t.delta() == "\ufffd"  # ... becomes U+FFFD at the end, as bytes.decode(errors="replace")
    assert held_back("abc</", ["</s>"]) == 2
