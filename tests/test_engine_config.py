"""One engine config, resolved once (:mod:`llmlib.engine.config`), and one place for each of the
engine's decisions: the run mode (:mod:`llmlib.engine.run_mode`), the fixed-shape step
(:mod:`llmlib.engine.fixed_step`) and the end of a sequence (:mod:`llmlib.engine.stopping`)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import llmlib
from llmlib.config import ModelConfig
from llmlib.engine import LLM, EngineConfig
from llmlib.engine.config import RUN_MODES
from llmlib.kernels.flags import forced
from llmlib.model import random_model

PKG = Path(llmlib.__file__).parent
CFG = ModelConfig("t", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _model() -> torch.nn.Module:
    return random_model(CFG, "cpu", seed=0)


def test_keywords_become_one_frozen_config():
    llm = LLM(_model(), None, num_blocks=32, block_size=4, max_num_seqs=3)
    ec = llm.engine_config
    assert isinstance(ec, EngineConfig) and (ec.num_blocks, ec.block_size) == (32, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ec.num_blocks = 1  # type: ignore[misc]
    # a config given whole, a keyword on top of it wins
    again = LLM(_model(), None, config=EngineConfig(num_blocks=32, block_size=4), max_num_seqs=2)
    assert again.engine_config.max_num_seqs == 2 and again.engine_config.block_size == 4
    with pytest.raises(TypeError, match="LLM: .*unexpected keyword argument 'num_block'"):
        LLM(_model(), None, num_block=32)
    for bad in (dict(block_size=0), dict(num_blocks=-1), dict(max_num_seqs=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="run_mode"):
        EngineConfig(run_mode="fast")


def test_every_default_is_resolved_once_and_described():
    with forced(compile_default=True):
        llm = LLM(_model(), None, num_blocks=16, block_size=4)  # a model handed in: eager
    ec = llm.engine_config
    fields = dataclasses.asdict(ec)
    unset = [k for k, v in fields.items() if v is None]
    assert set(unset) <= {"quantization", "group_size", "tp_options", "speculative_config"}
    assert ec.run_mode == "eager" and ec.device == torch.device("cpu") and ec.compile is False
    assert ec.max_model_len == CFG.max_seq_len and ec.max_num_batched_tokens == 512
    line = ec.describe()
    assert "cpu, float32 activations, steps eager" in line and "16 KV blocks of 4" in line
    assert llm.runner.mode == ec.run_mode
    assert ec.as_dict()["device"] == "cpu" and ec.as_dict()["num_blocks"] == 16


@pytest.mark.parametrize(
    "fields, mode",
    [
        (dict(), "eager"),
        (dict(cuda_graphs=True), "fixed"),
        (dict(compile=True), "compiled"),
        (dict(batch_invariant=True), "invariant"),
        (dict(batch_invariant=True, compile=True), "invariant-compiled"),
    ],
)
def test_the_run_mode_is_picked_in_one_place(fields, mode):
    m = _model()
    ec = EngineConfig(num_blocks=16, block_size=4, **fields).resolved(m, m)
    assert ec.run_mode == mode and mode in RUN_MODES


def test_one_sequence_takes_the_one_request_format(smollm2_path):
    """``llmlib generate`` (one sequence) loads the format ``load_model`` picks for one request;
    a batching engine the batch format: they may differ by design, and each says which."""
    from llmlib.device import choose_format

    one = EngineConfig(max_num_seqs=1).with_format(smollm2_path)
    many = EngineConfig().with_format(smollm2_path)
    place, q = choose_format(None, None, None, gguf_blocks=True)
    assert (one.device, one.dtype, one.quantization) == (place.device, place.dtype, q)
    place, q = choose_format(None, None, None, gguf_blocks=True, batched=True)
    assert (many.device, many.dtype, many.quantization) == (place.device, place.dtype, q)
    asked = EngineConfig(dtype="float32").with_format(smollm2_path)
    assert asked.dtype == torch.float32 and asked.quantization is None


def _defines(tree: ast.AST, cls_methods: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if cls_methods <= names:
                found.append(node.name)
    return found


def test_one_fixed_shape_step_module_and_one_stopping_module():
    """The fixed-shape step (a cache view that attends and is refilled in place each step) is
    defined in llmlib.engine.fixed_step only: no second stack beside it. A finish reason is
    decided in llmlib.engine.stopping only: no other module returns or assigns one."""
    fixed, decides = [], []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        text = p.read_text()
        if _defines(ast.parse(text), {"attend", "fill"}):
            fixed.append(rel)
        if re.search(r'(return|=)\s*"(length|stop)"', text) and rel != "engine/stopping.py":
            decides.append(rel)
    assert fixed == ["engine/fixed_step.py"] and decides == []
    assert not (PKG / "runtime" / "static.py").exists()
