"""What real clients send, through the official ``openai`` client: logprobs (both formats), echo,
``max_tokens=0`` scoring, ``n > 1`` (streamed with an index per choice), penalties and biases,
stop tokens, structured output, cached tokens, /tokenize, /detokenize and /metrics.

Every log-probability is checked against the model itself (log-softmax of its logits over the
whole sequence, no cache); structured outputs are checked with ``jsonschema``.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from llmlib.config import ModelConfig  # noqa: E402
from llmlib.serve import Limits, ServerThread, create_app  # noqa: E402

pytestmark = pytest.mark.model  # SmolLM2's tokenizer comes from its GGUF file

MODEL_ID = "tiny-random"


@pytest.fixture(scope="module")
def tokenizer():
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.tokenizer import load_tokenizer

    return load_tokenizer(fetch_model(quiet=True))


@pytest.fixture(scope="module")
def model(tokenizer):
    from llmlib.model import random_model

    cfg = ModelConfig(
        name="tiny",
        vocab_size=tokenizer.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=256,
        eos_token_ids=(2,),
    )
    return random_model(cfg, device="cpu", dtype=torch.float32, seed=0, std=0.5)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    from llmlib.engine import AsyncLLM

    eng = AsyncLLM(model, tokenizer, max_queue=64, num_blocks=256, block_size=16, max_num_seqs=32)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, MODEL_ID, limits=Limits(max_prompt_chars=4000))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def test_completion_logprobs_and_echo_match_the_model(client, model, tokenizer):
    prompt = "The rain in Spain"
    r = client.completions.create(
        model=MODEL_ID,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    ids = tokenizer.encode(prompt)
    with torch.inference_mode():  # the greedy continuation, recomputed without any cache
        full = list(ids)
        for _ in range(4):
            full.append(int(model(torch.tensor([full]))[0, -1].argmax()))
    ref = _reference_logprobs(model, full)
    lp = c.logprobs
    assert c.text == prompt + tokenizer.decode(full[len(ids) :])
    assert lp.tokens == [tokenizer.id_to_bytes(t).decode("utf-8", "replace") for t in full]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    for i in range(1, len(full)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, full[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) >= 3 and lp.tokens[i] in lp.top_logprobs[i]
        best = ref[i - 1].topk(3)
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(
            best.values.tolist(), abs=1e-4
        )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i in range(len(ids), len(full)):  # greedy: the chosen token is the most likely one
        top = lp.top_logprobs[i]
        assert max(top, key=top.get) == lp.tokens[i]


def test_max_tokens_zero_with_echo_scores_the_prompt(client, model, tokenizer):
    ids = tokenizer.encode("Four score and seven years ago")
    r = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert c.text == tokenizer.decode(ids)
    ref = _reference_logprobs(model, ids)
    want = [None] + [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:  # without echo, 0 tokens is an error
        client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_chat_logprobs_streaming_and_not(client):
    kw = dict(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy
    assert "".join(t.token for t in content) == r.choices[0].message.content
    streamed = [
        t
        for ch in client.chat.completions.create(stream=True, **kw)
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])


def test_n_choices_share_the_prompt_and_stream_with_index(client, engine):
    kw = dict(
        model=MODEL_ID,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body={"ignore_eos": True},
    )
    before = engine.stats().prefill_tokens
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # each choice its own random stream
    assert r.usage.completion_tokens == 18
    # the prompt was computed once, not three times
    assert engine.stats().prefill_tokens - before <= r.usage.prompt_tokens
    # seeded: the same request again gives the same choices (that choice i draws from seed + i,
    # exactly as a lone request would, is checked in the engine's tests with a small vocabulary;
    # here a lone request runs in smaller batches, whose float32 products round differently)
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    texts = {0: "", 1: "", 2: ""}
    reasons = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in r.choices} and reasons == dict.fromkeys(
        texts, "length"
    )


def test_penalties_bias_and_stop_tokens(client, tokenizer):
    base = dict(model=MODEL_ID, prompt="Hello there", max_tokens=6, temperature=0)
    forced = tokenizer.encode(" cat")[0]
    r = client.completions.create(
        **base, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == tokenizer.decode([forced] * 6)
    # a frequency penalty larger than the bias's margin stops the repetition
    r2 = client.completions.create(
        **base,
        logit_bias={str(forced): 5},
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert r2.choices[0].text != r.choices[0].text
    # the forced token as a stop token, with min_tokens holding it off for 3 tokens
    r3 = client.completions.create(
        **base,
        logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced], "min_tokens": 3, "ignore_eos": True},
    )
    c = r3.choices[0]
    assert c.finish_reason == "stop" and r3.usage.completion_tokens == 4
    # include_stop_str_in_output keeps the stop string
    text = r.choices[0].text
    r4 = client.completions.create(
        **base,
        logit_bias={str(forced): 100},
        stop=[" cat cat"],
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    assert r4.choices[0].text == " cat cat" and r4.choices[0].finish_reason == "stop"
    assert text.startswith(r4.choices[0].text)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def test_structured_output_always_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "Describe someone."}],
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = client.completions.create(
        model=MODEL_ID,
        prompt="JSON:",
        max_tokens=60,
        seed=5,
        stream=True,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), SCHEMA)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                },
            },
        )
    assert e.value.body["param"] == "response_format" and "nowhere" in e.value.body["message"]


def test_completion_prompt_parses_special_tokens_chat_does_not(client, tokenizer):
    r = client.completions.create(model=MODEL_ID, prompt="a<|im_end|>b", max_tokens=1)
    im_end = tokenizer.special_tokens["<|im_end|>"]
    assert r.usage.prompt_tokens == len(tokenizer.encode("a<|im_end|>b", allowed_special="all"))
    assert im_end in tokenizer.encode("a<|im_end|>b", allowed_special="all")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "a<|im_end|>"}], max_tokens=1
        )
    assert e.value.body["param"] == "messages[0].content"


def test_cached_tokens_tokenize_detokenize_metrics(client, server, tokenizer):
    prompt = "A shared system prompt that is long enough to fill a few blocks of sixteen. " * 3
    client.completions.create(model=MODEL_ID, prompt=prompt + "one", max_tokens=1)
    r = client.completions.create(model=MODEL_ID, prompt=prompt + "two", max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    t = httpx.post(
        server.url + "/tokenize",
        json={"model": MODEL_ID, "prompt": "Hello world", "return_token_strs": True},
    ).json()
    assert t["tokens"] == tokenizer.encode("Hello world") and t["count"] == len(t["tokens"])
    assert "".join(t["token_strs"]) == "Hello world" and t["max_model_len"] == 256
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > 3
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d == {"prompt": "Hello world"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "llmlib:num_requests_running",
        "llmlib:num_requests_waiting",
        "llmlib:kv_cache_usage_perc",
        "llmlib:prefix_cache_hits_total",
        "llmlib:num_preemptions_total",
        "llmlib:time_to_first_token_seconds_bucket",
        "llmlib:inter_token_latency_seconds_bucket",
        "llmlib:e2e_request_latency_seconds",
        "llmlib:generation_tokens_total",
        "llmlib:prompt_tokens_total",
    ):
        assert name in text, name
    hits = [ln for ln in text.splitlines() if ln.startswith("llmlib:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) >= 16


def test_openapi_describes_every_field(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for f in (
        "prompt",
        "logprobs",
        "echo",
        "n",
        "presence_penalty",
        "logit_bias",
        "response_format",
        "stop_token_ids",
        "min_tokens",
        "max_tokens",
        "temperature",
    ):
        assert f in props, f
    assert props["temperature"]["maximum"] == 2.0
    assert httpx.get(server.url + "/docs").status_code == 200


def test_deeply_nested_body_is_400(server):
    deep = (
        '{"model": "tiny-random", "prompt": "hi", "tools": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    r = httpx.post(
        server.url + "/v1/completions", content=deep, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_body_size_is_bounded(server):
    big = b'{"model": "tiny-random", "prompt": "' + b"x" * 400_000 + b'"}'
    r = httpx.post(
        server.url + "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the body is counted as it arrives
        yield b'{"model": "tiny-random", "prompt": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}'

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_speculating_server_reports_its_acceptance(model, tokenizer):
    """``llmlib serve --speculative``: the engine drafts, and /metrics says how many drafts were
    proposed and kept."""
    from llmlib.engine import AsyncLLM
    from llmlib.speculative import SpeculativeConfig

    eng = AsyncLLM(
        model,
        tokenizer,
        max_queue=8,
        num_blocks=64,
        block_size=16,
        speculative_config=SpeculativeConfig("early_exit", 2, exit_layer=1),
    )
    with ServerThread(create_app(eng.start(), MODEL_ID)) as srv:
        try:
            body = {
                "model": MODEL_ID,
                "prompt": "one two three one two three one two three one two",
                "max_tokens": 24,
                "temperature": 0,
            }
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
            text = httpx.get(srv.url + "/metrics").text
        finally:
            eng.shutdown()

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"llmlib:{name}_total"))
        return float(line.split()[-1])

    proposed = value("spec_decode_num_draft_tokens")
    assert proposed > 0 and 0 <= value("spec_decode_num_accepted_tokens") <= proposed
