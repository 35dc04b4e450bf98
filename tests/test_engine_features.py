"""The engine's request features, each against a reference: log-probabilities against the model's
own logits without a cache, ``n > 1`` against independent seeded requests (and the prompt
computed once, its blocks shared), penalties and biases against OpenAI's formula, stop tokens,
``min_tokens``, ``include_stop_str_in_output``, ``max_tokens=0`` scoring, and structured output
validated with ``jsonschema``."""

from __future__ import annotations

import json

import pytest
import torch

from llmlib.config import ModelConfig
from llmlib.engine import LLM
from llmlib.sampling import SamplingParams, apply_penalties
from llmlib.tokenizer import train_bpe

TEXT = 'the cat sat on the mat. the dog ran to the park; a bird sang {"a": 1} [1, 2] ' * 40


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXT, vocab_size=400, pattern="gpt4", special_tokens=["<|end|>"])


@pytest.fixture(scope="module")
def model(tok):
    from llmlib.model import random_model

    cfg = ModelConfig(
        name="tiny",
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=128,
        eos_token_ids=(tok.special_tokens["<|end|>"],),
    )
    return random_model(cfg, device="cpu", dtype=torch.float32, seed=0, std=0.5)


def _llm(model, tok, **kw):
    return LLM(model, tok, num_blocks=kw.pop("num_blocks", 64), block_size=4, **kw)


def _ref(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def test_logprobs_are_the_raw_log_softmax(model, tok):
    llm = _llm(model, tok)
    ids = tok.encode("the cat sat on the")
    # temperature and top-k do not change the reported logprobs: they are of the raw logits
    sp = SamplingParams(
        max_tokens=5,
        temperature=0.7,
        top_k=3,
        seed=1,
        logprobs=4,
        prompt_logprobs=2,
        ignore_eos=True,
    )
    o = llm.generate([ids], sp, use_tqdm=False)[0]
    lp = _ref(model, ids + o.token_ids)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        e = o.prompt_logprobs[j]
        assert e.token_id == ids[j] and e.logprob == pytest.approx(
            lp[j - 1, ids[j]].item(), abs=1e-5
        )
        assert e.rank == int((lp[j - 1] > lp[j - 1, ids[j]]).sum()) + 1 and len(e.top) == 2
    for j, e in enumerate(o.logprobs):
        p = len(ids) + j - 1
        assert e.token_id == o.token_ids[j]
        assert e.logprob == pytest.approx(lp[p, e.token_id].item(), abs=1e-5)
        assert [t for t, _ in e.top] == lp[p].topk(4).indices.tolist()
    # prompt logprobs are never taken from the prefix cache: a repeat gives them all again
    again = llm.generate([ids], sp, use_tqdm=False)[0]
    assert [e and e.logprob for e in again.prompt_logprobs] == [
        e and e.logprob for e in o.prompt_logprobs
    ]


def test_max_tokens_zero_scores_the_prompt(model, tok):
    llm = _llm(model, tok)
    ids = tok.encode("a bird sang")
    o = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert o.token_ids == [] and o.text == "" and o.finish_reason == "length"
    lp = _ref(model, ids)
    assert [e.logprob for e in o.prompt_logprobs[1:]] == pytest.approx(
        [lp[j - 1, ids[j]].item() for j in range(1, len(ids))], abs=1e-5
    )
    two = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0, n=2), use_tqdm=False)
    assert [c.token_ids for c in two[0].outputs] == [[], []]
    assert llm.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("prompt", ["the cat sat on the", "the cat sat on the mat. the dog"])
def test_n_forks_the_prompt_blocks(model, tok, prompt):
    """n choices: the prompt computed once (full blocks shared, the partial last one copied),
    choice i equal to a lone request with seed + i."""
    ids = tok.encode(prompt)
    llm = _llm(model, tok, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=7, temperature=1.0, seed=3, n=4, ignore_eos=True, logprobs=0)
    llm.add_request(ids, sp, request_id="r")
    shared = None
    while llm.has_unfinished_requests():
        outs = llm.step()
        running = llm.scheduler.running
        if len(running) == 4 and shared is None:
            llm.block_manager.check_consistency(running)
            full = len(ids) // 4
            shared = [llm.block_manager.blocks[b].ref_count for b in running[0].block_table[:full]]
        for out in outs:
            if out.finished:
                final = out
    assert shared == [4] * (len(ids) // 4)
    assert llm.stats().prefill_tokens == len(ids)  # computed once, not four times
    assert llm.block_manager.num_used_blocks == 0
    solo = _llm(model, tok, enable_prefix_caching=False)
    for c in final.outputs:
        one = solo.generate(
            [ids],
            SamplingParams(max_tokens=7, temperature=1.0, seed=3 + c.index, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert one.token_ids == c.token_ids and one.text == c.text
        assert len(c.logprobs) == 7
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_fork_without_a_free_block_recomputes(model, tok):
    """A pool with no block left for the copy: the other choices wait and are recomputed, and
    still equal the lone seeded requests."""
    ids = tok.encode("the cat sat on the mat")
    llm = _llm(model, tok, num_blocks=6, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=3, ignore_eos=True)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    solo = _llm(model, tok)
    for c in out.outputs:
        one = solo.generate(
            [ids],
            SamplingParams(max_tokens=3, temperature=1.0, seed=5 + c.index, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert one.token_ids == c.token_ids
    assert llm.block_manager.num_used_blocks == 0


def test_openai_penalties_formula():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    outs = [[3, 3, 7], []]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: -100, 9: 3.0}),
        SamplingParams(),
    ]
    got = apply_penalties(logits, params, None, outs)
    want = logits.clone()
    want[0, 3] -= 2 * 0.25 + 0.5
    want[0, 7] -= 0.25 + 0.5
    want[0, 1] -= 100
    want[0, 9] += 3
    torch.testing.assert_close(got, want)
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(logit_bias={1: 101}),
        dict(logit_bias={i: 1 for i in range(301)}),
        dict(logprobs=21),
        dict(n=0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stop_tokens_min_tokens_and_stop_strings(model, tok):
    llm = _llm(model, tok)
    ids = tok.encode("the dog")
    forced = tok.encode(" cat")[0]
    bias = {forced: 100.0}
    o = llm.generate(
        [ids],
        SamplingParams(
            max_tokens=8, temperature=0, logit_bias=bias, stop_token_ids=[forced], min_tokens=2
        ),
        use_tqdm=False,
    )[0]
    assert o.finish_reason == "stop" and len(o.token_ids) == 3 and o.token_ids[-1] == forced
    assert o.outputs[0].stop_reason == forced and " cat" not in o.text
    o = llm.generate(
        [ids],
        SamplingParams(
            max_tokens=8,
            temperature=0,
            logit_bias=bias,
            stop=[" cat cat"],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0]
    assert o.text == " cat cat" and o.outputs[0].stop_reason == " cat cat"
    o = llm.generate(
        [ids],
        SamplingParams(max_tokens=8, temperature=0, logit_bias=bias, stop=[" cat"], min_tokens=3),
        use_tqdm=False,
    )[0]
    # stop strings are looked for once min_tokens are out, in the newest text only (vLLM's rule)
    assert len(o.token_ids) == 3 and o.text == " cat cat"


def test_structured_output_validates(model, tok):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"enum": ["cat", "dog"]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    llm = _llm(model, tok)
    ids = tok.encode("the cat")
    outs = llm.generate(
        [ids] * 6,
        [
            SamplingParams(max_tokens=40, temperature=1.0, seed=s, json_schema=schema)
            for s in range(6)
        ],
        use_tqdm=False,
    )
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    with pytest.raises(ValueError, match="compiled"):
        llm.add_request(ids, SamplingParams(json_schema={"type": "nonsense"}))
