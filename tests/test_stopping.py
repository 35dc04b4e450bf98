"""The one place a sequence's end is decided (llmlib.engine.stopping), case by case."""

from __future__ import annotations

import pytest

from llmlib.engine import stopping
from llmlib.engine.sequence import Sequence
from llmlib.sampling import SamplingParams
from llmlib.text import TextStream

EOS, STOP = 200, 201
PROMPT = [1, 2, 3]


def byte(i: int) -> bytes:
    return {EOS: b"<eos>", STOP: b"<stop>"}.get(i, bytes([i]))


class Grammar:
    """A stand-in for a structured-output matcher: done after ``n`` tokens."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, []

    def consume(self, tok: int) -> None:
        self.seen.append(tok)

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.n


def seq(max_tokens: int = 8, grammar: Grammar | None = None, **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, **params)
    s = Sequence(
        1,
        PROMPT,
        max_tokens,
        eos_token_ids=frozenset({EOS}),
        ignore_eos=p.ignore_eos,
        params=p,
        stop_token_ids=frozenset(p.stop_token_ids),
        matcher=grammar,
    )
    s.text = TextStream(byte, p.stop, include_stop=p.include_stop_str_in_output)
    return s


def feed(s: Sequence, tokens: list[int], max_model_len: int = 64) -> list[str | None]:
    out = []
    for t in tokens:
        s.token_ids.append(t)
        out.append(stopping.take(s, t, max_model_len))
        if out[-1]:
            break
    return out


def test_eos_ends_it_and_is_not_text() -> None:
    s = seq()
    assert feed(s, [ord("a"), EOS]) == [None, "stop"]
    assert s.text.text == "a" and s.text.closed and s.stop_reason is None


def test_ignore_eos_decodes_past_it() -> None:
    s = seq(ignore_eos=True)
    assert feed(s, [ord("a"), EOS, ord("b")]) == [None, None, None]
    assert s.text.text == "a<eos>b"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ends_it_even_under_ignore_eos(include) -> None:
    s = seq(ignore_eos=True, stop_token_ids=[STOP], include_stop_str_in_output=include)
    assert feed(s, [ord("x"), STOP]) == [None, "stop"]
    assert s.stop_reason == STOP
    assert s.text.text == ("x<stop>" if include else "x")


def test_a_stop_string_ends_it_only_after_min_tokens() -> None:
    s = seq(stop=["ab"], min_tokens=3)
    # "ab" completes at the second token, before min_tokens: it does not count
    assert feed(s, [ord("a"), ord("b"), ord("a"), ord("b")]) == [None, None, None, "stop"]
    assert s.stop_reason == "ab" and s.text.text == "ab"


def test_a_finished_grammar_ends_it_and_eos_after_it_is_not_text() -> None:
    s = seq(grammar=Grammar(2), ignore_eos=True)
    assert feed(s, [ord("{"), ord("}")]) == [None, "stop"]
    assert s.text.text == "{}" and s.text.closed
    s = seq(grammar=Grammar(2), ignore_eos=True)
    assert feed(s, [ord("{"), EOS]) == [None, "stop"]
    assert s.text.text == "{"


def test_lengths() -> None:
    s = seq(max_tokens=2)
    assert feed(s, [ord("a"), ord("b"), ord("c")]) == [None, "length"]
    s = seq(max_tokens=50)
    assert feed(s, [ord("a")] * 10, max_model_len=len(PROMPT) + 4) == [None] * 3 + ["length"]
    # a stop string on the last allowed token is a stop, not a length
    s = seq(max_tokens=2, stop=["b"])
    assert feed(s, [ord("a"), ord("b")]) == [None, "stop"]


def test_a_prompt_only_request() -> None:
    assert stopping.prompt_only(seq(max_tokens=0, prompt_logprobs=1)) == "length"
    assert stopping.prompt_only(seq(max_tokens=1)) is None
