"""The fast path without asking: ``LLM(path)``, ``llmlib generate``/``chat`` and ``serve`` compile
their CPU decode steps unless told not to (``compile=False``, ``--no-compile``,
``LLMLIB_COMPILE=0``), and not in the modes that run steps of their own. The test suite itself
runs with ``LLMLIB_COMPILE=0`` (conftest.py), so the default is checked here under forced flags;
tests/test_aot.py builds an ``LLM(path)`` with the default and checks its step came from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmlib.device import compiles_by_default
from llmlib.kernels.flags import forced, read

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_flag_is_read_from_the_environment():
    assert read(env={}).compile_default is True
    assert read(env={"LLMLIB_COMPILE": "0"}).compile_default is False
    assert read(env={"LLMLIB_COMPILE": "1"}).compile_default is True
    with pytest.raises(ValueError, match="LLMLIB_COMPILE"):
        read(env={"LLMLIB_COMPILE": "yes"})


def test_a_path_on_a_cpu_compiles_by_default():
    with forced(compile_default=True):
        assert compiles_by_default("m.gguf", CPU) and compiles_by_default(Path("folder"), CPU)
        assert not compiles_by_default(torch.nn.Linear(2, 2), CPU)  # built in memory: as built
        assert not compiles_by_default("m.gguf", CUDA)  # CUDA graphs are the GPU's fast path
        assert not compiles_by_default("m.gguf", CPU, speculative=object())
    with forced(compile_default=False):
        assert not compiles_by_default("m.gguf", CPU)


def test_the_batch_invariant_mode_compiles_by_default_where_its_groups_are_faster():
    """Where the CPU has AMX its compiled groups outran its eager steps; as a Zen 4 or an
    AVX2-only EPYC, not (``results/cpu/batching_invariant_as_*.json``).
    ``LLMLIB_INVARIANT_COMPILE`` forces it."""
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    for cpu, want in ((avx512 | {"amx_bf16"}, True), (avx512, False), ({"avx2", "fma"}, False)):
        assert read(env={}, cpu=("GenuineIntel", frozenset(cpu))).invariant_compile is want
    assert read(env={"LLMLIB_INVARIANT_COMPILE": "0"}).invariant_compile is False
    with pytest.raises(ValueError, match="LLMLIB_INVARIANT_COMPILE"):
        read(env={"LLMLIB_INVARIANT_COMPILE": "fast"})
    for on in (True, False):
        with forced(compile_default=True, invariant_compile=on):
            assert compiles_by_default("m.gguf", CPU, batch_invariant=True) is on
            assert compiles_by_default("m.gguf", CPU)  # the default engine compiles either way


def resolved_compile(source="m.gguf", **fields) -> bool:
    """Whether an engine given ``fields`` (an :class:`~llmlib.engine.config.EngineConfig`'s)
    compiles its steps, for a checkpoint ``source`` on this CPU: the one place that decides."""
    from llmlib.config import ModelConfig
    from llmlib.engine.config import EngineConfig
    from llmlib.model import random_model

    cfg = ModelConfig(
        "t", vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32
    )
    model = random_model(cfg, "cpu")
    return EngineConfig(**fields).resolved(model, model if source is None else source).compile


def test_the_engine_config_compiles_a_checkpoint_by_default():
    with forced(compile_default=True):
        assert resolved_compile() and resolved_compile(Path("folder"))
        assert not resolved_compile(None)  # a model built in memory stays as built
        assert not resolved_compile(compile=False)
        assert not resolved_compile(speculative_config=object())
        assert resolved_compile(speculative_config=object(), compile=True)
    with forced(compile_default=False):
        assert not resolved_compile() and resolved_compile(compile=True)


@pytest.mark.parametrize(
    "argv, env_default, want",
    [
        ([], True, True),
        (["--no-compile"], True, False),
        (["--speculative", "ngram:3"], True, False),
        (["--speculative", "ngram:3", "--compile"], True, True),
        ([], False, False),
        (["--compile"], False, True),
    ],
)
def test_generate_compiles_by_default(kwargs_of, argv, env_default, want):
    """``llmlib generate`` hands the engine one config, for one sequence, whose resolution
    compiles by default on a CPU."""
    import llmlib.cli.generate as G
    import llmlib.engine

    with forced(compile_default=env_default):
        seen = kwargs_of(llmlib.engine, "LLM", lambda: G.main(["hello", "--device", "cpu", *argv]))
        config = seen["config"]
        assert config.max_num_seqs == 1
        fields = {k: getattr(config, k) for k in ("compile", "speculative_config")}
        assert resolved_compile(**fields) is want
