"""A fuzzing pass over the server's OpenAPI document with ``schemathesis``: requests generated
from every operation's schema, valid and invalid (wrong types, out-of-range values, missing
fields), must never get a 5xx nor crash the server, and ``/health`` stays 200 throughout."""

from __future__ import annotations

import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from llmlib.config import ModelConfig  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL_ID = "tiny-random"


@pytest.fixture(scope="module")
def app():
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.engine import AsyncLLM
    from llmlib.model import random_model
    from llmlib.serve import Limits, create_app
    from llmlib.tokenizer import load_tokenizer

    tok = load_tokenizer(fetch_model(quiet=True))
    cfg = ModelConfig(
        name="tiny",
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=64,
        max_seq_len=96,
        eos_token_ids=(2,),
    )
    model = random_model(cfg, device="cpu", dtype=torch.float32, seed=0)
    engine = AsyncLLM(model, tok, max_queue=64, num_blocks=128, block_size=16, max_num_seqs=16)
    engine.start()
    # small bounds keep each generated request cheap; the bounds themselves are what is fuzzed
    yield create_app(engine, MODEL_ID, limits=Limits(max_prompt_chars=400, max_n=4))
    engine.shutdown()


@pytest.fixture(scope="module")
def api(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def _fix(case) -> None:
    """Point generated completions at the served model (otherwise nearly every case stops at the
    404) and keep them short; every other field stays as generated."""
    if isinstance(case.body, dict) and case.path.startswith("/v1/"):
        case.body["model"] = MODEL_ID
        if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 8:
            case.body["max_tokens"] = 8


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_error(api, app, mode):
    from starlette.testclient import TestClient

    ops = [r.ok() for r in api.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    seen = {}
    with TestClient(app) as http:
        for op in ops:
            if op.method.upper() != "POST":
                continue

            @settings(
                max_examples=40,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                _fix(case)
                r = _send(http, case)
                assert r.status_code < 500, (case.path, case.body, r.text[:500])
                if r.status_code >= 400:
                    err = r.json()["error"]
                    assert err["message"] and err["type"]
                seen[r.status_code] = seen.get(r.status_code, 0) + 1

            run()
        assert http.get("/health").status_code == 200
    assert sum(seen.values()) >= 40, seen
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= s < 500 for s in seen), seen


def _send(http, case):
    """The generated request, through the app in-process (raw bytes go as they are)."""
    headers = dict(case.headers or {})
    body = case.body
    kw = {}
    if isinstance(body, (bytes, str)):
        kw["content"] = body
        headers.setdefault("content-type", case.media_type or "application/json")
    elif body is not None:
        kw["json"] = body
    return http.request(case.method, case.formatted_path, params=case.query, headers=headers, **kw)
