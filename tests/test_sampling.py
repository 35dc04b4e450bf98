"""Sampling: every knob against a hand-computed expectation, seeds, per-row params, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from llmlib.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    argmax_rows,
    filter_logits,
    probabilities,
    sample,
)


def _row(*probs: float) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [49152, 32000, 128256, 151936, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_argmax(vocab, dtype):
    """The chunked argmax gives torch's indices: ties go to the first maximum (bfloat16 has many),
    a NaN wins as in argmax, and vocabularies with no power-of-two chunk fall back."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    x[1] = 0.0  # one tie across every chunk
    x[2, [7, vocab - 1]] = 99.0  # a tie in the first and the last chunk
    x[3, vocab // 2] = float("nan")
    x[4, -3:] = 50.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[1] == 0 and argmax_rows(x)[2] == 7


def test_temperature_scales_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0])
    for t in (0.5, 1.0, 2.0):
        p = probabilities(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(p, torch.softmax(logits / t, -1))
    assert probabilities(logits, SamplingParams(temperature=0.0)).tolist() == [1.0, 0.0, 0.0]


def test_top_k_keeps_k_tokens():
    logits = _row(0.4, 0.3, 0.2, 0.1)
    p = probabilities(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(p, torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)
    assert (probabilities(logits, SamplingParams(top_k=100)) > 0).all()  # k past the vocab = off


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _row(0.5, 0.3, 0.15, 0.05)
    # 0.5 < 0.7, 0.5+0.3 >= 0.7: the nucleus is the first two tokens
    p = probabilities(logits, SamplingParams(top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    # a tiny p still keeps the top token
    assert probabilities(logits, SamplingParams(top_p=1e-6)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (probabilities(logits, SamplingParams(top_p=1.0)) > 0).all()


def test_min_p_is_relative_to_the_top_token():
    logits = _row(0.5, 0.3, 0.15, 0.05)
    # threshold 0.4 * 0.5 = 0.2: keeps 0.5 and 0.3
    p = probabilities(logits, SamplingParams(min_p=0.4))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert (probabilities(logits, SamplingParams(min_p=0.0)) > 0).all()


def test_filters_compose_like_hugging_face():
    # compare with transformers' own warpers applied in its order (temperature, top-k, top-p, min-p)
    tr = pytest.importorskip("transformers")
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 200, generator=g) * 3
    ref = logits.clone()
    for w in (
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(50),
        TopPLogitsWarper(0.9),
        MinPLogitsWarper(0.05),
    ):
        ref = w(None, ref)
    ours = filter_logits(
        logits, torch.tensor([0.7]), torch.tensor([50]), torch.tensor([0.9]), torch.tensor([0.05])
    )
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1))
    del tr


def test_repetition_penalty_matches_the_ctrl_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # in sample(): the repeated top token loses to the next one
    tok = sample(
        torch.tensor([[2.0, 1.5, 0.0]]),
        [SamplingParams(temperature=0, repetition_penalty=2.0)],
        seen=[[0]],
    )
    assert tok.tolist() == [1]
    with pytest.raises(ValueError, match="seen"):
        sample(torch.tensor([[2.0, 1.5]]), [SamplingParams(repetition_penalty=2.0)])


def test_seed_reproduces_and_rows_are_independent():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=123)

    def draws(params: SamplingParams, other_rows: int) -> list[int]:
        batch = logits.repeat(1 + other_rows, 1)
        ps = [params] + [SamplingParams(temperature=1.5, seed=7 + i) for i in range(other_rows)]
        gens = [q.make_generator() for q in ps]
        return [int(sample(batch, ps, gens)[0]) for _ in range(20)]

    a, b = draws(p, 0), draws(p, 3)
    assert a == b  # the same seed gives the same tokens whatever else is in the batch
    assert draws(SamplingParams(temperature=1.0, seed=124), 0) != a
    assert len(set(a)) > 1  # it really samples


def test_sampling_frequencies_follow_the_distribution():
    logits = _row(0.6, 0.3, 0.1).unsqueeze(0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [g])[0]] += 1
    torch.testing.assert_close(
        counts / counts.sum(), torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0
    )


def test_mixed_batch_greedy_and_sampled_rows():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    ps = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1, seed=0),
        SamplingParams(temperature=0),
    ]
    out = sample(logits, ps, [p.make_generator() for p in ps])
    assert out.tolist() == logits.argmax(-1).tolist()  # top_k=1 sampling is greedy too


def test_stop_accepts_one_string():
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(temperature=-0.1), ValueError),
        (dict(temperature=float("nan")), ValueError),
        (dict(temperature=float("inf")), ValueError),
        (dict(temperature="hot"), TypeError),
        (dict(top_k=0), ValueError),
        (dict(top_k=-3), ValueError),
        (dict(top_k=2.5), TypeError),
        (dict(top_k=True), TypeError),
        (dict(top_p=0.0), ValueError),
        (dict(top_p=1.5), ValueError),
        (dict(top_p=-0.2), ValueError),
        (dict(min_p=-0.1), ValueError),
        (dict(min_p=1.1), ValueError),
        (dict(repetition_penalty=0.0), ValueError),
        (dict(repetition_penalty=-1.0), ValueError),
        (dict(seed=-1), ValueError),
        (dict(seed=1.5), TypeError),
        (dict(max_tokens=0), ValueError),
        (dict(max_tokens=2.0), TypeError),
        (dict(stop=[""]), ValueError),
        (dict(stop=[1, 2]), TypeError),
        (dict(ignore_eos="yes"), TypeError),
    ],
)
def test_invalid_params_raise(kwargs, exc):
    field = next(iter(kwargs))
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


def test_sample_shape_errors():
    with pytest.raises(ValueError, match="batch"):
        sample(torch.zeros(2, 5), [SamplingParams()])
    with pytest.raises(ValueError, match="shape"):
        sample(torch.zeros(5), [SamplingParams()])
    with pytest.raises(ValueError, match="generators"):
        sample(torch.zeros(2, 5), [SamplingParams()] * 2, [None])


def test_long_tail_probability_is_preserved_when_off():
    logits = torch.randn(32000, generator=torch.Generator().manual_seed(0))
    p = probabilities(logits, SamplingParams(top_k=None, top_p=None, min_p=None))
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    torch.testing.assert_close(p, logits.softmax(-1))


def test_draw_follows_the_distribution_and_each_row_its_own_stream():
    from llmlib.sampling import draw

    p = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]]).repeat(20_000, 1)
    counts = torch.bincount(draw(p, [None] * len(p)), minlength=5).float() / len(p)
    assert counts[0] == 0 and counts[2] == 0  # a token of zero mass is never drawn
    torch.testing.assert_close(counts, p[0], atol=0.015, rtol=0)
    # a seeded row's draws depend on its own generator only, not on the rows beside it
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = sample(logits[1:2], [SamplingParams(seed=7)], [SamplingParams(seed=7).make_generator()])
    batch = sample(
        logits,
        [SamplingParams(), SamplingParams(seed=7), SamplingParams(seed=3)],
        [None, SamplingParams(seed=7).make_generator(), SamplingParams(seed=3).make_generator()],
    )
    assert batch[1] == alone[0]
