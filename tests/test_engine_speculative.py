"""Prompt-lookup speculation in the batching engine: the same tokens as plain decoding while
sequences verify proposals in the same steps as others decode, and every block comes back."""

from __future__ import annotations

import random

import pytest
import torch
from test_speculative import Tok, tiny

from llmlib.engine import LLM
from llmlib.generate import Generator
from llmlib.sampling import SamplingParams
from llmlib.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def model():
    m = tiny(vocab=64, layers=2, seed=5)
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # peaked logits: batched and batch-1 float32 agree on argmax
    return m


def _workload():
    rng = random.Random(0)
    prompts = []
    for i in range(24):
        motif = [rng.randrange(64) for _ in range(rng.randint(2, 6))]
        body = motif * rng.randint(1, 6) if i % 3 else [rng.randrange(64) for _ in range(20)]
        prompts.append(body[: rng.randint(1, len(body))])
    return prompts, [rng.randint(1, 30) for _ in prompts]


def _engine(model, spec, **kw):
    opts = dict(block_size=4, num_blocks=160, max_num_batched_tokens=40, dtype=torch.float32)
    return LLM(model, Tok(), speculative_config=spec, **{**opts, **kw})


def test_engine_ngram_greedy_equals_the_generator_and_returns_every_block(model):
    prompts, max_tokens = _workload()
    gen = Generator(model, Tok())
    want = [
        gen.generate(p, max_new_tokens=n, ignore_eos=True).token_ids
        for p, n in zip(prompts, max_tokens)
    ]
    llm = _engine(model, SpeculativeConfig("ngram", 4))
    bm = llm.block_manager
    rids = [
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_tokens)
    ]
    final, mixed = {}, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out
        running = llm.scheduler.running
        # after every step each sequence holds just the blocks its tokens need: the blocks that
        # only refused proposals had were returned at once
        assert all(len(s.block_table) <= bm.blocks_for(s.num_tokens) for s in running)
        bm.check_consistency(running)
        mixed += any(s.draft_tokens for s in running) and len(running) > 1
    assert mixed > 0  # some steps verified proposals alongside other sequences' work
    got = [final[r].outputs[0].token_ids for r in rids]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} requests differ, first {bad[0]}"
    st = llm.stats()
    assert st.spec_accepted > 0 and st.spec_accepted < st.spec_proposed  # kept and refused
    # fewer forward passes than tokens: proposals were verified in steps that did other work
    assert st.forward_passes < sum(max_tokens)
    assert llm.block_manager.num_free_blocks == 160  # every block back on the free list
    llm.block_manager.check_consistency([])


def test_engine_ngram_stop_strings_and_a_tight_pool_match_plain_decoding(model):
    """Stop strings found inside a verified run of tokens end the text where plain decoding
    would; a small pool (preemptions, proposals dropped for want of blocks) changes nothing."""
    prompts, max_tokens = _workload()
    params = [
        SamplingParams(temperature=0.0, max_tokens=n + 10, ignore_eos=True, stop=["ab", "zz"])
        for n in max_tokens
    ]
    base = _engine(model, None, num_blocks=40)
    plain = base.generate(prompts, params, use_tqdm=False)
    llm = _engine(model, SpeculativeConfig("ngram", 6, prompt_lookup_min=2), num_blocks=40)
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    st = llm.stats()
    assert st.spec_accepted > 0 and base.stats().preemptions > 0  # the pool was tight
    assert st.preemptions <= base.stats().preemptions  # proposals never cost a preemption
    assert llm.block_manager.num_free_blocks == 40
    llm.block_manager.check_consistency([])


def test_engine_ngram_sampling_runs_and_refuses_other_methods(model):
    prompts, max_tokens = _workload()
    llm = _engine(model, SpeculativeConfig("ngram", 4))
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, seed=i) for i, n in
              enumerate(max_tokens)]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    assert llm.block_manager.num_free_blocks == 160
    with pytest.raises(ValueError, match="exit_layer must be in 1..2"):
        _engine(model, SpeculativeConfig("early_exit", 2, exit_layer=5))
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(model, SpeculativeConfig("draft", 2, draft_model=tiny(vocab=32, layers=1)))


def _draft_spec(model, method: str, k: int = 3) -> SpeculativeConfig:
    if method == "early_exit":
        return SpeculativeConfig("early_exit", k, exit_layer=1)
    from test_speculative import near_copy

    return SpeculativeConfig("draft", k, draft_model=near_copy(model, 0.02))


@pytest.mark.parametrize("method", ["early_exit", "draft"])
def test_engine_model_drafts_greedy_equal_the_generator(model, method):
    """The model's first layer, or a second model, drafts in the engine: every sequence's tokens
    are plain greedy decoding's, drafts were kept and refused, every block comes back."""
    prompts, max_tokens = _workload()
    gen = Generator(model, Tok())
    want = [
        gen.generate(p, max_new_tokens=n, ignore_eos=True).token_ids
        for p, n in zip(prompts, max_tokens)
    ]
    llm = _engine(model, _draft_spec(model, method))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} requests differ, first {bad[0]}"
    st = llm.stats()
    assert 0 < st.spec_accepted < st.spec_proposed
    assert llm.block_manager.num_free_blocks == 160
    llm.block_manager.check_consistency([])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_sampling_keeps_the_distribution(method):
    """Many seeded requests of three tokens on a 6-token vocabulary, batched: tokens 2 and 3
    come out of one verification, and their joint frequencies fit plain sampling's exact
    distribution (chi-square at about 1e-4)."""
    from test_speculative import _chi2, _chi2_bound, _exact_pair_distribution

    V = 6
    target = tiny(V, layers=2, seed=3, std=0.6)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True)
    exact = _exact_pair_distribution(target, prompt, params)
    spec = SpeculativeConfig("ngram", 2) if method == "ngram" else _draft_spec(target, method, 2)
    llm = _engine(target, spec, num_blocks=400, max_num_seqs=128)
    reqs = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(2000)]
    outs = llm.generate([prompt] * len(reqs), reqs, use_tqdm=False)
    counts = torch.zeros(V * V)
    for o in outs:
        t = o.outputs[0].token_ids
        counts[t[1] * V + t[2]] += 1
    st = llm.stats()
    assert 0 < st.spec_accepted < st.spec_proposed
    stat, df = _chi2(counts, exact)
    assert stat < _chi2_bound(df), stat
    assert llm.block_manager.num_free_blocks == 400
