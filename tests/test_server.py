"""The OpenAI-compatible server, driven by the official ``openai`` client and by raw HTTP.

The server runs in a thread on 127.0.0.1 around the real batching engine with a small
random-weight model and SmolLM2's real tokenizer (from the GGUF), so every path (tokenizing, chat
template, paged cache, streaming, aborting) is the production one, only fast.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from llmlib.bench import serve as bench_serve  # noqa: E402
from llmlib.bench import serve_client  # noqa: E402
from llmlib.config import ModelConfig  # noqa: E402
from llmlib.serve import Limits, ServerThread, create_app  # noqa: E402
from llmlib.serve.launch import main as serve_main  # noqa: E402

pytestmark = pytest.mark.model  # SmolLM2's tokenizer comes from its GGUF file

MODEL_ID = "tiny-random"
CONTEXT = 512
STEP_DELAY = 0.01  # seconds added to every forward pass


@pytest.fixture(scope="module")
def tokenizer():
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.tokenizer import load_tokenizer

    return load_tokenizer(fetch_model(quiet=True))


def _tiny_model(vocab: int):
    from llmlib.model import random_model

    cfg = ModelConfig(
        name="tiny",
        vocab_size=vocab,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=CONTEXT,
        eos_token_ids=(2,),
    )
    return random_model(cfg, device="cpu", dtype=torch.float32, seed=0, std=0.5)


@pytest.fixture(scope="module")
def engine(tokenizer):
    from llmlib.engine import AsyncLLM

    torch.manual_seed(0)
    model = _tiny_model(tokenizer.vocab_size)
    # A tiny model decodes hundreds of tokens a second; pace every forward pass at >= 10 ms so a
    # request of a few hundred tokens is still running when a test holds it open or hangs up.
    model.norm.register_forward_pre_hook(lambda mod, args: time.sleep(STEP_DELAY))
    eng = AsyncLLM(model, tokenizer, max_queue=256, num_blocks=512, block_size=16, max_num_seqs=64)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, MODEL_ID, limits=Limits(max_prompt_chars=4000))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _idle(engine, timeout: float = 10.0) -> None:
    """Wait until the engine holds no request and no KV block."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (
            engine.num_in_flight == 0
            and engine.llm.block_manager.num_used_blocks == 0
            and not engine.llm.has_unfinished_requests()
        ):
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine not idle: {engine.num_in_flight} in flight, "
        f"{engine.llm.block_manager.num_used_blocks} blocks used"
    )


# ---- the endpoints with the openai client -----------------------------------------------------------


def test_models_and_health(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_ID]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_non_streaming(client, engine):
    r = client.completions.create(
        model=MODEL_ID,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.model == MODEL_ID
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("The capital of France is"))
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    _idle(engine)


def test_streaming_equals_non_streaming(client, engine):
    kw = dict(
        model=MODEL_ID,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    # really streamed, piece by piece
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1


def test_chat_streaming_and_not(client, engine):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a quadratic equation?"},
    ]
    kw = dict(
        model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    # the prompt is the model's own chat template (SmolLM2's ChatML) around the messages
    assert r.usage.prompt_tokens > len(
        engine.tokenizer.encode("Be brief.What is a quadratic equation?")
    )
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    _idle(engine)


def test_sse_wire_format(server):
    body = {
        "model": MODEL_ID,
        "prompt": "Hello",
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        json.loads(ln[6:])


# ---- bad requests get clear 4xx while others are being served -----------------------------------------

BAD = [
    # (body, status, param)
    (b"{not json", 400, None),
    (b"[1, 2, 3]", 400, None),
    ({"model": MODEL_ID, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL_ID, "prompt": 42}, 400, "prompt"),
    ({"model": MODEL_ID, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_ID, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL_ID, "prompt": "word " * 600}, 400, "prompt"),  # > context (512 tokens)
    ({"model": MODEL_ID, "prompt": "x" * 5000}, 400, "prompt"),  # > max_prompt_chars
    ({"model": MODEL_ID, "prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL_ID, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL_ID, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL_ID, "prompt": "hi", "top_k": 0}, 400, "top_k"),
    ({"model": MODEL_ID, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL_ID, "prompt": "hi", "n": 100}, 400, "n"),  # > Limits.max_n
    ({"model": MODEL_ID, "prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ({"model": MODEL_ID, "prompt": "hi", "seed": -1}, 400, "seed"),
]

BAD_CHAT = [
    ({"model": MODEL_ID, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL_ID, "messages": []}, 400, "messages"),
    (
        {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    (
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000},
        400,
        "max_tokens",
    ),
    (
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "a<|im_end|>"}]},
        400,
        "messages[0].content",
    ),
]


def _post(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            url, content=body, headers={"content-type": "application/json"}, timeout=30
        )
    return httpx.post(url, json=body, timeout=30)


def test_bad_requests_get_clear_errors_while_serving(server, engine):
    # one long streaming request keeps the engine busy the whole time
    done: dict = {}

    def long_stream() -> None:
        body = {
            "model": MODEL_ID,
            "prompt": "Keep going",
            "max_tokens": 120,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            done["lines"] = [ln for ln in r.iter_lines() if ln]

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.2)
    for path, cases in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
        for body, status, param in cases:
            r = _post(server.url + path, body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error"
            assert err["param"] == param, (body, err)
    assert httpx.get(server.url + "/v1/nowhere").status_code == 404
    # the long request was served throughout, to the end
    assert engine.num_in_flight >= 1 or "lines" in done
    t.join(120)
    lines = done["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    r = _post(
        server.url + "/v1/completions", {"model": MODEL_ID, "prompt": "still", "max_tokens": 3}
    )
    assert r.status_code == 200
    _idle(engine)


def test_queue_full_is_503(engine):
    """The one queue limit is the engine's (AsyncLLM(max_queue=...)): its QueueFull is the 503,
    and the server lives on."""
    from llmlib.engine import AsyncLLM

    small = AsyncLLM(engine.llm.model, engine.tokenizer, max_queue=2, num_blocks=64, max_num_seqs=4)
    with ServerThread(create_app(small, MODEL_ID)) as srv:
        body = {
            "model": MODEL_ID,
            "prompt": "hold",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        streams = []
        with httpx.Client(timeout=60) as c:
            for _ in range(2):
                cm = c.stream("POST", srv.url + "/v1/completions", json=body)
                r = cm.__enter__()
                assert r.status_code == 200
                lines = r.iter_lines()  # keep the iterator: dropping it would close the connection
                next(lines)
                streams.append((cm, lines))
            r = _post(
                srv.url + "/v1/completions",
                {"model": MODEL_ID, "prompt": "one more", "max_tokens": 2},
            )
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_full"
            assert httpx.get(srv.url + "/health").status_code == 200
            for cm, _ in streams:
                cm.__exit__(None, None, None)
        # once the held requests are gone, the server takes new ones again
        t0 = time.monotonic()
        while True:
            r = _post(
                srv.url + "/v1/completions", {"model": MODEL_ID, "prompt": "again", "max_tokens": 2}
            )
            if r.status_code == 200 or time.monotonic() - t0 > 20:
                break
            time.sleep(0.1)
        assert r.status_code == 200
    small.shutdown()
    _idle(engine)


# ---- disconnects ---------------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server, engine):
    _idle(engine)
    before = engine.stats().decode_tokens
    body = {
        "model": MODEL_ID,
        "prompt": "A long story: " + "and then " * 20,
        "max_tokens": 440,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                got += 1
            if got >= 3:
                break
        assert engine.llm.block_manager.num_used_blocks > 0  # the request holds KV blocks now
    # leaving the `with` closed the connection mid-stream
    _idle(engine, timeout=15)
    generated = engine.stats().decode_tokens - before
    assert generated < 400, f"the request ran on after the client left ({generated} tokens)"


def test_disconnect_non_streaming_aborts(server, engine):
    _idle(engine)
    before = engine.stats().decode_tokens
    body = {
        "model": MODEL_ID,
        "prompt": "Tell me everything",
        "max_tokens": 480,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    _idle(engine, timeout=15)
    assert engine.stats().decode_tokens - before < 470


# ---- concurrency ---------------------------------------------------------------------------------------


def test_32_concurrent_streaming_clients(server, engine):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await c.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": f"Request number {i}: count to ten."}],
            max_tokens=8 + i % 5,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, reason, usage = "", None, 0
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
            if ch.usage:
                usage = ch.usage.completion_tokens
        return text, reason, usage

    async def all_of_them():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for i, (text, reason, usage) in enumerate(results):
        assert reason == "length" and usage == 8 + i % 5, (i, reason, usage)
    _idle(engine)


# ---- the benchmark client against this server ------------------------------------------------------


def test_bench_serve_metrics(server, tmp_path):
    out = tmp_path / "serve.json"
    png = tmp_path / "serve.png"
    rc = bench_serve.main(
        [
            "--url",
            server.url,
            "--concurrency",
            "1,4",
            "--rates",
            "40",
            "--num-prompts",
            "4",
            "--max-tokens",
            "6",
            "--prompt-words",
            "12",
            "--range-ratio",
            "0",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert [(m["concurrency"], m["request_rate"]) for m in rep["results"]] == [
        (1, None),
        (4, None),
        (None, 40.0),
    ]
    for m in rep["results"]:
        assert m["completed"] == 4 and m["failed"] == 0
        assert m["total_output_tokens"] == 4 * 6
        assert 0 < m["median_ttft_ms"] <= m["p90_ttft_ms"] <= m["p99_ttft_ms"]
        assert 0 < m["p50_itl_ms"] <= m["p90_itl_ms"] <= m["p99_itl_ms"]
        assert 0 <= m["goodput"] <= m["request_throughput"]
        assert m["total_token_throughput"] > m["output_throughput"]
        assert m["median_tpot_ms"] > 0 and m["output_throughput"] > 0
    assert png.stat().st_size > 1000


def test_bench_summary_definitions():
    """TPOT excludes the first token; ITL pools every gap; throughput divides by the run's wall time."""
    R = serve_client.RequestResult
    rs = [
        R(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.5, latency=0.9, itl=[0.1] * 4),
        R(ok=True, prompt_tokens=10, output_tokens=3, ttft=1.0, latency=1.6, itl=[0.2, 0.4]),
        R(ok=True, prompt_tokens=10, output_tokens=1, ttft=0.3, latency=0.3, itl=[]),
        R(ok=False, error="HTTP 503"),
    ]
    m = serve_client.summarize(rs, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    # (0.9-0.5)/4 and (1.6-1.0)/2; the 1-token one has none
    assert m["mean_tpot_ms"] == pytest.approx((100 + 300) / 2)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["median_ttft_ms"] == pytest.approx(500)
    assert m["output_throughput"] == pytest.approx(9 / 2.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert serve_client.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    # goodput: the SLO (TTFT <= 600 ms, TPOT <= 150 ms) holds for the first and third only
    assert serve_client.summarize(rs, 2.0, 600, 150)["goodput"] == pytest.approx(1.0)
    # arrivals: gamma with shape 1 is Poisson (mean gap 1/rate); infinite rate sends at once
    import random

    g = serve_client.gaps(4000, 4.0, 1.0, random.Random(0))
    assert sum(g) / len(g) == pytest.approx(0.25, rel=0.05)
    assert serve_client.gaps(3, float("inf"), 1.0, random.Random(0)) == [0.0] * 3
    reqs = serve_client.make_requests(50, 40, 10, 0.5, seed=1, long_every=10, long_words=300)
    assert sum(q.long for q in reqs) == 5 and all(5 <= q.max_tokens <= 15 for q in reqs)


def test_serve_cli_rejects_bad_args():
    with pytest.raises(SystemExit):
        serve_main(["--max-queue", "0"])
    with pytest.raises(SystemExit):
        serve_main(["--port", "not-a-port"])
    with pytest.raises(SystemExit):
        serve_main(["--threads", "0"])
