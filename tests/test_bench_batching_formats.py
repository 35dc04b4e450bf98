"""``llmlib bench batching --formats``: every format through the engine in one run, and vLLM as a
peer through its own interpreter (here a stand-in ``vllm`` package, since vLLM is an optional
extra that lives in its own environment)."""

from __future__ import annotations

import json
import sys

import pytest

from llmlib.bench._workload import Request
from llmlib.bench.batching_formats import _token_share, run_vllm

FAKE_VLLM = """
import os

class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, ids):
        self.token_ids = ids

class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]

class LLM:
    def __init__(self, folder, dtype, **kw):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no such dtype: " + dtype)
        assert os.path.exists(os.path.join(folder, "config.json")), folder

    def generate(self, prompts, params, use_tqdm=False):
        # the "model": repeat each prompt's last token
        return [_Req([p["prompt_token_ids"][-1]] * s.max_tokens) for p, s in zip(prompts, params)]
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        FAKE_VLLM + "\n__version__ = os.environ['VLLM_CPU_OMP_THREADS_BIND']\n"
    )
    (pkg / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return dict(prompt_token_ids=prompt_token_ids)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_token_share_counts_positions() -> None:
    assert _token_share([[1, 2, 3], [4]], [[1, 9, 3], [4]]) == 0.75
    assert _token_share([], []) == 0.0


def test_vllm_peer_protocol(fake_vllm, monkeypatch) -> None:
    """The peer runs in a child interpreter, gets the token ids and the thread binding, and
    returns one timing per repeat and its tokens; a failure raises with the child's log."""
    reqs = [Request([5, 6, 7], 4), Request([8, 9], 2)]
    out = run_vllm(
        sys.executable, fake_vllm, "bfloat16", reqs, threads=2, repeats=3, max_num_seqs=8
    )
    assert len(out["seconds"]) == 3 and all(s >= 0 for s in out["seconds"])
    assert out["outputs"] == [[7, 7, 7, 7], [9, 9]]
    assert out["version"] == "0-1"  # the fake reports the cores it was bound to
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match="no such dtype: float16"):
        run_vllm(sys.executable, fake_vllm, "float16", reqs, threads=2, repeats=1, max_num_seqs=8)


@pytest.mark.model
def test_formats_side_by_side_with_a_peer(smollm2_path, fake_vllm, tmp_path, capsys) -> None:
    """Two formats and the (stand-in) peer on the same requests: ratios against float32 from the
    same run, float32 agreeing with itself, and an unknown format refused by name."""
    from llmlib.bench import batching

    out = tmp_path / "res.json"
    argv = ["--model", str(smollm2_path), "--formats", "float32,bfloat16,bfloat16+invariant"]
    argv += ["--num-requests", "3"]
    argv += ["--output-len", "3", "3", "--prompt-len", "5", "9", "--repeats", "1"]
    argv += ["--threads", "2", "--perplexity-tokens", "64"]
    argv += ["--vllm-python", sys.executable, "--out", str(out)]
    assert batching.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["name"]: r for r in res["formats"]}
    assert rows["float32"]["vs_float32"] == 1.0 and rows["float32"]["same_tokens_as_float32"] == 1.0
    assert rows["bfloat16"]["continuous_tokens_per_s"] > 0
    assert rows["float32"]["perplexity_vs_float32"] == 1.0
    assert 0.9 < rows["bfloat16"]["perplexity_vs_float32"] < 1.1
    assert 0 <= rows["bfloat16"]["kl_vs_float32"] < 0.1
    r = rows["bfloat16"]
    assert r["vs_float32"] == pytest.approx(
        r["continuous_tokens_per_s"] / rows["float32"]["continuous_tokens_per_s"], rel=1e-2
    )
    (peer,) = res["peers"]
    assert peer["name"] == "vllm bfloat16" and len(peer["seconds_all_runs"]) == 1
    assert peer["llmlib_vs_vllm"] == pytest.approx(
        r["continuous_tokens_per_s"] / peer["tokens_per_s"], rel=1e-2
    )
    assert 0 <= peer["same_tokens_as_float32"] <= 1
    assert "vllm bfloat16" in capsys.readouterr().out
    inv = rows["bfloat16+invariant"]  # batch-invariant mode, priced against the same format
    assert inv["batch_invariant"] and "vs_compiled" not in inv
    assert inv["vs_eager"] == pytest.approx(
        inv["continuous_tokens_per_s"] / r["continuous_tokens_per_s"], rel=1e-2
    )
    with pytest.raises(SystemExit):
        batching.main(argv[:3] + ["bfloat17"] + argv[4:])
    assert "--formats: unknown format 'bfloat17'" in capsys.readouterr().err
    # ``+compile`` is the compiled engine (LLM(compile=True), tests/test_engine.py)
    from llmlib.bench.batching_formats import format_names

    assert format_names("float32,bfloat16+compile") == ["float32", "bfloat16+compile"]
    assert format_names("gguf+invariant") == ["gguf+invariant"]
    with pytest.raises(ValueError, match="bf16"):
        format_names("bf16+invariant")
