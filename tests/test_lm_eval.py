"""lm-evaluation-harness through the server: ``local-completions`` against ``llmlib serve`` gives
the same scores as lm-eval's own ``hf`` backend on the same weights (a tiny random Llama saved by
``transformers``), on a multiple-choice task of our own stored under ``data/lm_eval`` (no network).

lm-eval is large (datasets, pandas, scikit-learn ...), so it is not in the ``test`` extra: this
test skips when it is not installed (``pip install lm-eval``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    from llmlib.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("tiny-llama")
    text = (TASK_DIR / "tiny_mc.json").read_text() * 20
    bpe = train_bpe(text, vocab_size=320, pattern="gpt4", special_tokens=["<|endoftext|>"])
    bpe.save(str(folder / "tokenizer.json"))
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    hf_tok.save_pretrained(folder)
    cfg = transformers.LlamaConfig(
        vocab_size=bpe.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        eos_token_id=hf_tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


def _evaluate(model: str, model_args: str, monkeypatch) -> dict:
    evaluator = pytest.importorskip("lm_eval.evaluator")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASK_DIR)  # the task's data_files are relative to its folder
    return evaluator.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["llmlib_tiny_mc"],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=4,
        log_samples=True,
        random_seed=0,
    )


@pytest.mark.slow
def test_local_completions_through_llmlib_serve_equals_hf(tiny_llama, monkeypatch):
    pytest.importorskip("lm_eval")
    from llmlib.engine import AsyncLLM
    from llmlib.serve import ServerThread, create_app

    hf = _evaluate("hf", f"pretrained={tiny_llama},dtype=float32,device=cpu", monkeypatch)
    # float32, as transformers runs: without a dtype the engine picks bfloat16 on a CPU with it
    engine = AsyncLLM(str(tiny_llama), dtype="float32", num_blocks=256, block_size=16).start()
    try:
        with ServerThread(create_app(engine, "tiny-llama")) as s:
            ours = _evaluate(
                "local-completions",
                f"model=tiny-llama,base_url={s.url}/v1/completions,tokenizer={tiny_llama},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
                monkeypatch,
            )
    finally:
        engine.shutdown()
    a, b = hf["results"]["llmlib_tiny_mc"], ours["results"]["llmlib_tiny_mc"]
    assert a["acc,none"] == b["acc,none"] and a["acc_norm,none"] == b["acc_norm,none"]
    # and every choice's log-likelihood agrees, not just the argmax
    sa, sb = hf["samples"]["llmlib_tiny_mc"], ours["samples"]["llmlib_tiny_mc"]
    assert len(sa) == len(sb) == 20
    for x, y in zip(sorted(sa, key=lambda d: d["doc_id"]), sorted(sb, key=lambda d: d["doc_id"])):
        lx = [r[0][0] for r in x["resps"]]
        ly = [r[0][0] for r in y["resps"]]
        assert all(math.isclose(u, v, abs_tol=1e-3) for u, v in zip(lx, ly)), (lx, ly)
