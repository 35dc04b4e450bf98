"""Speculative decoding: greedy output identical to plain greedy, sampling distribution exact,
rollback leaves the cache as a fresh prefill would, the proposers and the config's spelling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import llmlib
from llmlib.config import ModelConfig
from llmlib.generate import Generator
from llmlib.model import random_model
from llmlib.model.kv_cache import KVCache
from llmlib.sampling import SamplingParams
from llmlib.speculative import (
    NgramProposer,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
    distributions,
    lookup,
)


class Tok:
    """Token i is the byte ``a + i % 26``; no end token (the tests pass ``ignore_eos``)."""

    eos_id = None
    bos_id = None

    def encode(self, text, allowed_special=()):
        return [ord(c) % 32 for c in text]

    def id_to_bytes(self, i):
        return bytes([97 + i % 26])

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def tiny(vocab: int = 64, layers: int = 4, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    cfg = ModelConfig(
        name="tiny",
        vocab_size=vocab,
        d_model=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=1024,
    )
    return random_model(cfg, device="cpu", dtype=torch.float32, seed=seed, std=std)


def near_copy(model: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """The same model with a little noise on every weight: a draft that mostly agrees."""
    draft = tiny(model.config.vocab_size, model.config.n_layers, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.state_dict().items(), draft.state_dict().items()):
            q.copy_(p + noise * torch.randn(p.shape, generator=g))
    return draft


PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3],  # repeats: prompt lookup finds matches
    [9, 40, 33, 2, 17, 60, 5],  # no repeats
    list(range(10, 50)) * 3 + [10, 11],  # a long copy
    [3],  # one token
]


def _methods(model):
    return {
        "ngram": SpeculativeConfig("ngram", 4),
        "ngram:2:3": SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=3),
        "early_exit": SpeculativeConfig("early_exit", 3, exit_layer=2),
        "draft": SpeculativeConfig("draft", 5, draft_model=near_copy(model, 0.05)),
    }


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.mark.parametrize("method", ["ngram", "ngram:2:3", "early_exit", "draft"])
def test_greedy_speculation_is_token_for_token_plain_greedy(model, method):
    plain = Generator(model, Tok())
    spec = Generator(model, Tok(), speculative=_methods(model)[method])
    accepted = 0
    for prompt in PROMPTS:
        for n in (1, 2, 37):
            want = plain.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids
            out = spec.generate(prompt, max_new_tokens=n, ignore_eos=True)
            assert out.token_ids == want, (method, prompt, n)
            assert out.speculative is not None and len(out.token_ids) == n
            assert out.timing.decode_tokens == n - 1
            accepted += out.speculative.accepted
    assert accepted > 0  # the proposals were kept sometimes: the equality tested the verifier


def test_greedy_speculation_stops_at_eos_and_context_end(model):
    class EosTok(Tok):
        eos_id = 31  # the plain greedy run below emits 31 after a few tokens

    prompt = PROMPTS[0]
    plain = Generator(model, EosTok()).generate(prompt, max_new_tokens=40)
    spec = Generator(model, EosTok(), speculative=SpeculativeConfig("ngram", 8))
    out = spec.generate(prompt, max_new_tokens=40)
    assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason
    # a context of 24 tokens, filled: k shrinks so verification never writes past the cache
    short = Generator(model, Tok(), max_len=24, speculative=SpeculativeConfig("ngram", 8))
    n = 24 - len(prompt)
    want = Generator(model, Tok(), max_len=24).generate(prompt, max_new_tokens=n, ignore_eos=True)
    got = short.generate(prompt, max_new_tokens=n, ignore_eos=True)
    assert got.token_ids == want.token_ids and len(got.token_ids) == n


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft"])
def test_after_rollback_the_cache_equals_a_fresh_prefill(model, method):
    """The cache a speculative run leaves (rejections rolled back) decodes the next token exactly
    as a cache-free pass over the whole sequence scores it: no stale key or value is visible."""
    gen = Generator(model, Tok(), speculative=_methods(model)[method])
    prompt = PROMPTS[0]
    out = gen.generate(prompt, max_new_tokens=30, ignore_eos=True)
    s = out.speculative
    assert s.accepted > 0 and s.accepted < s.proposed  # both keeps and rollbacks happened
    seq = prompt + out.token_ids
    cache = gen._cache
    assert cache.length == len(seq) - 1  # everything but the last token is stored
    with torch.inference_mode():
        step = model(torch.tensor([[seq[-1]]]), torch.tensor([[len(seq) - 1]]), cache)[0, -1]
        fresh = model(torch.tensor([seq]))[0, -1]
    torch.testing.assert_close(step, fresh, rtol=1e-4, atol=1e-4)


def test_layer_view_shares_memory_with_its_own_length():
    cache = KVCache(4, 1, 2, 16, 8)
    cache.length = 5
    view = cache.layer_view(2)
    assert view.n_layers == 2 and view.length == 5
    assert view.k.data_ptr() == cache.k.data_ptr() and view.v.shape[0] == 2
    k = torch.randn(1, 2, 1, 8)
    view.update(0, k, k)
    view.update(1, k, k)
    assert view.length == 6 and cache.length == 5
    assert torch.equal(cache.k[1, :, :, 5:6], k)
    with pytest.raises(ValueError):
        cache.layer_view(5)


# ---- sampling: the distribution is exactly the model's ----------------------------------------


def _chi2_bound(df: int, z: float = 3.72) -> float:
    """The chi-square value exceeded with probability about 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected >= 5
    o = torch.cat([counts[keep].double(), counts[~keep].sum().double().view(1)])
    e = torch.cat([expected[keep].double(), expected[~keep].sum().double().view(1)])
    if e[-1] < 5:  # the lumped rare cells are too rare even together: drop them
        o, e = o[:-1] * (counts.sum() / o[:-1].sum()), e[:-1]
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


P = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.1, 0.2, 0.3, 0.2, 0.2], [0.2] * 5])
Q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.1, 0.2, 0.1]])


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_emits_the_target_distribution(one_hot):
    """Proposals drawn from q (or fixed, one-hot), verified against p: the first token out is
    distributed as p[0], the second (when the first was a kept proposal) as p[1]."""
    g = torch.Generator().manual_seed(0)
    first = torch.zeros(5)
    second = torch.zeros(5)
    N = 12000
    for _ in range(N):
        d = [2, 0] if one_hot else torch.multinomial(Q, 1, generator=g)[:, 0].tolist()
        a, nxt = accept_sampled(d, None if one_hot else Q, P, g)
        out = [*d[:a], nxt]
        first[out[0]] += 1
        if a >= 1:
            second[out[1]] += 1
    for counts, p in ((first, P[0]), (second, P[1])):
        stat, df = _chi2(counts, p)
        assert stat < _chi2_bound(df), (counts / counts.sum(), p)


def _exact_pair_distribution(model, prompt, params) -> torch.Tensor:
    """P(token 2, token 3) of plain sampling, [V*V], enumerated over every token 1 and 2."""
    V = model.config.vocab_size
    with torch.inference_mode():
        p1 = distributions(model(torch.tensor([prompt]))[0, -1:], params)[0]
        pairs = torch.tensor([prompt + [a] for a in range(V)])
        p2 = distributions(model(pairs)[:, -1], params)  # [V (t1), V (t2)]
        triples = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        p3 = distributions(model(triples)[:, -1], params).view(V, V, V)  # t1, t2 -> t3
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).flatten()


@pytest.mark.parametrize("method", ["ngram", "draft", "early_exit"])
def test_speculative_sampling_matches_plain_sampling(method):
    """Many seeded draws of three tokens from a 6-token vocabulary; tokens 2 and 3 come from one
    verification. Their joint frequencies must fit the exact distribution of plain sampling
    (chi-square at about 1e-4); keeping every proposal, or drawing a refusal's replacement from
    p instead of the residual, fails this by far."""
    V = 6
    target = tiny(V, layers=2, seed=3, std=0.6)
    draft = tiny(V, layers=2, seed=4, std=0.6)
    spec = {
        "ngram": SpeculativeConfig("ngram", 2),
        "draft": SpeculativeConfig("draft", 2, draft_model=draft),
        "early_exit": SpeculativeConfig("early_exit", 2, exit_layer=1),
    }[method]
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    exact = _exact_pair_distribution(target, prompt, params)
    gen = Generator(target, Tok(), speculative=spec)
    counts = torch.zeros(V * V)
    proposed = accepted = 0
    for seed in range(2000):
        params.seed = seed
        out = gen.generate(prompt, params)
        counts[out.token_ids[1] * V + out.token_ids[2]] += 1
        proposed += out.speculative.proposed
        accepted += out.speculative.accepted
    assert 0 < accepted < proposed  # proposals were both kept and refused
    stat, df = _chi2(counts, exact)
    assert stat < _chi2_bound(df), stat


# ---- the pieces ---------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_latest_match():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurred at 1 and 6; the latest (6) is followed by 7 8 5
    assert lookup(seq, 3, 1, 4) == [7, 8, 5]
    assert lookup(seq, 10, 1, 4) == [7, 8, 5, 2, 3]  # up to the end of the sequence
    assert lookup([5, 1, 2, 3], 2, 2, 3) == []  # no n-gram of 2..3 tokens recurs
    assert lookup([5, 1, 2, 3], 2, 1, 3) == []  # nor does the last token
    assert lookup([4, 4, 4], 2, 1, 2) == [4]  # "4 4" at 0 is followed by one token
    assert NgramProposer(1, 2).propose([7, 1, 7], 4).tokens == [1, 7]
    assert lookup([1], 3) == [] and lookup([1, 1], 0) == []


def test_accept_greedy_keeps_the_matching_prefix_and_adds_the_models_token():
    logits = torch.eye(6)[[3, 4, 5, 1]]  # the model's argmax after each position: 3 4 5 1
    assert accept_greedy([3, 4, 5], logits) == (3, 1)  # all kept, then the bonus token
    assert accept_greedy([3, 2, 5], logits) == (1, 4)  # second refused: the model's 4 instead
    assert accept_greedy([], logits[:1]) == (0, 3)  # nothing proposed: a plain decode step


def test_config_spelling_and_checks():
    c = SpeculativeConfig.parse("ngram:4")
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.parse("ngram:3:2:5")
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    c = SpeculativeConfig.parse("early_exit:8:4")
    assert (c.method, c.exit_layer, c.num_speculative_tokens) == ("early_exit", 8, 4)
    c = SpeculativeConfig.parse("draft:3:/tmp/a:b.gguf")
    assert (c.draft_model, c.num_speculative_tokens) == ("/tmp/a:b.gguf", 3)
    for bad in ("ngrams:4", "ngram:x", "early_exit:8", "ngram:4:5:2", "draft:4"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError):
        SpeculativeConfig("early_exit", 4)  # no exit layer
    assert llmlib.SpeculativeConfig is SpeculativeConfig
    with pytest.raises(ValueError, match="vocabulary"):
        Generator(tiny(), Tok(), speculative=SpeculativeConfig("draft", 2, draft_model=tiny(32)))
    with pytest.raises(ValueError, match="exit_layer"):
        Generator(tiny(), Tok(), speculative=SpeculativeConfig("early_exit", 2, exit_layer=9))


def test_penalized_requests_decode_plainly(model):
    """A repetition penalty depends on every earlier token: such requests skip speculation."""
    spec = Generator(model, Tok(), speculative=SpeculativeConfig("ngram", 4))
    plain = Generator(model, Tok())
    kw = dict(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    out = spec.generate(PROMPTS[0], **kw)
    assert out.token_ids == plain.generate(PROMPTS[0], **kw).token_ids
    assert out.speculative is None
