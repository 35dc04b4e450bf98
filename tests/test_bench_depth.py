"""``llmlib bench depth``: prefill and decode at depth beside llama.cpp, and the KV cache's
perplexity cost; its helpers here, and one tiny run of llmlib alone on the real model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmlib.bench import depth
from llmlib.engine.outputs import TokenLogprob
from llmlib.perplexity import over_windows, windows


def test_prompt_of_gives_exactly_n_tokens_tiled_from_the_text() -> None:
    text = [5, 6, 7]
    assert depth.prompt_of(text, 7) == [5, 6, 7, 5, 6, 7, 5]
    assert depth.prompt_of(text, 2) == [5, 6]
    for n in (1, 3, 4, 512, 4097):
        assert len(depth.prompt_of(list(range(100)), n)) == n
    with pytest.raises(ValueError):
        depth.prompt_of([], 4)
    with pytest.raises(ValueError):
        depth.prompt_of(text, 0)


def test_nll_from_logits_and_from_prompt_logprobs_equal_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab, context, stride = 50, 11, 16, 8
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    total, count = 0.0, 0
    for begin, end, first in windows(n, context, stride):
        win = logits[begin:end]  # what a model returns for the window ids[begin:end]
        want = torch.nn.functional.cross_entropy(
            win[first - begin - 1 : end - begin - 1],
            torch.tensor(ids[first:end]),
            reduction="sum",
        ).item()
        assert depth._llama_cpp.window_nll(
            win.float().numpy(), ids, begin, end, first
        ) == pytest.approx(want, rel=1e-5)
        # the engine's prompt_logprobs: entry i is token i's log-probability, None for the first
        logp = torch.log_softmax(win, -1)
        entries = [None] + [
            TokenLogprob(ids[begin + i], float(logp[i - 1, ids[begin + i]]), 1)
            for i in range(1, end - begin)
        ]
        assert depth.logprobs_nll(entries, ids, begin, first, end) == pytest.approx(want)
        total, count = total + want, count + end - first
    assert count == n - 1  # every token but the first, once

    def nll(begin: int, end: int, first: int) -> float:
        return depth._llama_cpp.window_nll(logits[begin:end].numpy(), ids, begin, end, first)

    p = over_windows(nll, n, context, stride)
    assert p.tokens == n - 1 and p.perplexity == pytest.approx(math.exp(total / count))
    with pytest.raises(ValueError, match="not token"):  # misaligned entries are caught
        depth.logprobs_nll(entries, [t + 1 for t in ids], begin, first, end)


def test_arguments_reject_unknown_cache_types_and_depths(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        depth.main(["--kv-cache-dtype", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "unknown KV cache type 'fp8'" in err
    assert "auto, int8" in err
    assert depth.kv_list("auto,int8,auto") == ["auto", "int8"]
    with pytest.raises(SystemExit):
        depth.main(["--depths", "512,0"])
    assert "positive integers" in capsys.readouterr().err


def test_table_has_a_row_per_cache_and_depth_with_ratios() -> None:
    row = {
        "llmlib_prefill_s": 0.5, "llmlib_prefill_tokens_per_s": 1024.0,
        "llmlib_decode_tokens_per_s": 50.0, "llama_cpp_prefill_s": 0.25,
        "llama_cpp_prefill_tokens_per_s": 2048.0, "llama_cpp_decode_tokens_per_s": 40.0,
        "prefill_ratio": 0.5, "decode_ratio": 1.25,
    }  # fmt: skip
    res = {
        "model": "m.gguf", "threads": 2, "new_tokens": 64, "runs": 3,
        "llama_cpp_build": "AVX2", "llama_cpp_n_batch": 512,
        "rows": [{"kv_cache_dtype": kv, "depth": 512, **row} for kv in ("auto", "int8")],
        "kv_cache": {
            "auto": {"llmlib_bytes_per_token": 23040.0, "llama_cpp_type": "f16",
                     "llama_cpp_bytes_per_token": 23040.0},
            "int8": {"llmlib_bytes_per_token": None, "llama_cpp_type": "q8_0",
                     "llama_cpp_bytes_per_token": 12240.0},
        },
        "perplexity": {
            "tokens": 512, "context": 256, "stride": 128,
            "perplexity": {"llmlib": {"auto": 10.0, "int8": 10.1},
                           "llama.cpp": {"auto": 10.0, "int8": 10.02}},
            "vs_auto": {"llmlib": {"int8": 1.01}, "llama.cpp": {"int8": 1.002}},
        },
    }  # fmt: skip
    lines = depth.format_table(res).splitlines()
    assert "x llama" in lines[1] and "pp tok/s" in lines[1]
    assert lines[2].split()[:2] == ["auto", "512"] and lines[3].split()[:2] == ["int8", "512"]
    assert lines[2].split()[-3:] == ["50.0", "40.0", "1.25"]
    text = "\n".join(lines)
    assert "llama.cpp q8_0 12,240 B/token" in text and "llmlib - B/token" in text
    assert "int8 10.1000 (1.0100x auto)" in text


@pytest.mark.model  # about 3 s: loads the default model, eager
def test_a_tiny_run_scores_perplexity_through_the_engine(smollm2_path, tmp_path, capsys) -> None:
    from llmlib.perplexity import book_text_ids, perplexity

    out = tmp_path / "depth.json"
    argv = ["--no-llama-cpp", "--depths", "64", "--new-tokens", "4", "--runs", "1",
            "--perplexity-tokens", "128", "--perplexity-context", "64", "--out", str(out)]  # fmt: skip
    assert depth.main(argv) == 0
    assert "pp tok/s" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["model"] == smollm2_path.name and res["llama_cpp_build"] is None
    assert res["machine"]["cpu_count"] and res["threads"] == 2
    (row,) = res["rows"]
    assert row["kv_cache_dtype"] == "auto" and row["depth"] == 64
    for key in ("llmlib_prefill_s", "llmlib_prefill_tokens_per_s", "llmlib_decode_tokens_per_s"):
        assert row[key] > 0
    assert res["kv_cache"]["auto"]["llmlib_bytes_per_token"] > 0
    q = res["perplexity"]
    assert (q["tokens"], q["context"], q["stride"], q["scored_tokens"]) == (128, 64, 32, 127)
    ppl = q["perplexity"]["llmlib"]["auto"]
    # the same model's plain forward over the same windows: the engine's paged cache agrees
    llm = depth.llmlib_engine(smollm2_path, "auto", 64)
    ids = book_text_ids(llm.tokenizer, 128)
    assert ppl == pytest.approx(perplexity(llm.model, ids, 64, 32), rel=0.01)
