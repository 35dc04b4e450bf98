"""Perplexity over sliding windows: against a naive full pass, against transformers' method on the
real model, and the comparison of formats (KL, greedy agreement)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_gguf import TINY

import llmlib
from llmlib.model import random_model
from llmlib.perplexity import compare, perplexity, perplexity_details, windows


def test_windows_score_every_token_once() -> None:
    for n, ctx, stride in [(10, 4, 2), (9, 16, 8), (100, 32, 7), (5, 2, 1)]:
        scored = [t for _, end, first in windows(n, ctx, stride) for t in range(first, end)]
        assert scored == list(range(1, n)), (n, ctx, stride)
        assert all(end - begin <= ctx for begin, end, _ in windows(n, ctx, stride))
    # windows that do not overlap cannot score their first token (nothing before it in the window)
    scored = [t for _, end, first in windows(10, 4, 4) for t in range(first, end)]
    assert scored == [1, 2, 3, 5, 6, 7, 9]
    with pytest.raises(ValueError):
        list(windows(10, 4, 5))


def _naive_nll(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    return [-float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


def test_one_window_is_the_plain_mean_and_windows_see_only_their_context() -> None:
    model = random_model(TINY, "cpu", seed=1)
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    nll = _naive_nll(model, ids)
    assert math.isclose(perplexity(model, ids, 64, 32), math.exp(sum(nll) / len(nll)), rel_tol=1e-5)
    # context 16, stride 8: the tokens of window 2 are scored with only the 16 before them
    d = perplexity_details(model, ids, 16, 8)
    expect = nll[:15]  # window 0 scores tokens 1..15
    for begin, end, first in list(windows(len(ids), 16, 8))[1:]:
        expect += _naive_nll(model, ids[begin:end])[first - begin - 1 :]
    assert d.tokens == len(ids) - 1
    assert math.isclose(d.nll, sum(expect) / len(expect), rel_tol=1e-5)


def test_compare_is_zero_against_itself_and_positive_against_another() -> None:
    a = random_model(TINY, "cpu", seed=1)
    b = random_model(TINY, "cpu", seed=2)
    ids = list(range(3, 43))
    same = compare(a, a, ids, 16, 8)
    assert same.kl < 1e-6 and same.greedy_agreement == 1.0 and same.tokens == 39
    diff = compare(a, b, ids, 16, 8)
    assert diff.kl > 0.01 and diff.greedy_agreement < 1.0


@pytest.mark.model
def test_float32_perplexity_equals_transformers_on_the_same_windows(
    smollm2_path: Path, hf_smollm2
) -> None:
    """Hugging Face's sliding-window method (its perplexity guide), run on transformers' own model
    of the same file: llmlib's float32 figure agrees to 0.1%."""
    from llmlib.perplexity import book_text_ids

    tok = llmlib.load_tokenizer(smollm2_path)
    ids = book_text_ids(tok, 700)
    ctx, stride = 256, 128
    hf = hf_smollm2
    x = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, x.size(1), stride):
            end = min(begin + ctx, x.size(1))
            trg_len = end - prev_end
            inp = x[:, begin:end]
            target = inp.clone()
            target[:, :-trg_len] = -100
            loss = hf(inp, labels=target).loss
            valid = (target[:, 1:] != -100).sum().item()  # labels left after the internal shift
            nll_sum += loss.item() * valid
            n_tokens += valid
            prev_end = end
            if end == x.size(1):
                break
    ref = math.exp(nll_sum / n_tokens)
    model = llmlib.load_model(smollm2_path, "cpu", torch.float32)
    ours = perplexity_details(model, ids, ctx, stride)
    assert ours.tokens == n_tokens
    assert abs(ours.perplexity / ref - 1) < 1e-3, (ours.perplexity, ref)


@pytest.mark.model
def test_perplexity_cli_compares_a_format_with_float32(
    smollm2_path: Path, tmp_path: Path, capsys
) -> None:
    import json

    from llmlib.cli.perplexity import main

    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession " * 8)
    args = ["--model", str(smollm2_path), str(text), "--context", "64", "--stride", "32"]
    assert main([*args, "--quantization", "int8", "--compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "int8" in out["format"] and out["tokens"] > 50
    assert 0.9 < out["ratio"] < 1.1 and 0 <= out["kl"] and 0.5 < out["greedy_agreement"] <= 1
