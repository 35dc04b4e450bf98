"""Compiled decode steps kept on disk (llmlib.runtime.aot): compiled once, found again by their
key, loaded without a copy of the weights, and giving the eager step's tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_gguf import TINY, random_hf_weights, write_gguf

import llmlib
from llmlib.kernels.flags import forced
from llmlib.runtime import aot


class Tok:
    """Token i is the byte i."""

    eos_id = bos_id = None
    vocab_size = TINY.vocab_size
    special_tokens: dict = {}

    def id_to_bytes(self, i: int) -> bytes:
        return bytes([i % 256])

    def encode(self, text, allowed_special=None):
        return [b % TINY.vocab_size for b in text.encode()]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("aot")
    return write_gguf(d / "tiny.gguf", TINY, random_hf_weights(TINY, seed=4))


def test_one_request_compiled_once_then_loaded_from_disk(model_file, tmp_path, recwarn) -> None:
    """What ``llmlib generate`` runs: the engine with one sequence, its step compiled once into a
    package (code only) and loaded by the next engine; a batch of one runs its own size, unpadded,
    and gives the eager Generator's tokens, also over a history longer than the traced one."""
    prompt = [5, 9, 11, 3, 7]
    params = llmlib.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with forced(cache=tmp_path):
        model = llmlib.load_model(model_file, "cpu", "float32")
        eager = llmlib.Generator(model, Tok()).generate(prompt, params)
        first = llmlib.LLM(model, Tok(), compile=True, max_num_seqs=1)
        assert first.runner.decode_path == "compiled (now, cached)" and first.compile_s > 0
        packages = list((tmp_path / "compiled").glob("engine-*.pt2"))
        assert [p.name.split("-")[1] for p in packages] == ["one"]  # the one-row step alone
        assert not [w for w in recwarn if "LeafSpec" in str(w.message)]  # PyTorch's, not ours
        # the package holds code, not the weights: the model's own tensors are its constants
        assert packages[0].stat().st_size < 0.5 * model_file.stat().st_size + (4 << 20)
        out = first.generate([prompt], params, use_tqdm=False)[0]
        assert out.token_ids == eager.token_ids
        assert {rows for rows, _ in first.runner.graphs.steps.entries} == {1}  # no padding row
        again = llmlib.LLM(
            llmlib.load_model(model_file, "cpu", "float32"), Tok(), compile=True, max_num_seqs=1
        )
        assert again.runner.decode_path == "compiled (from the cache)" and again.compile_s is None
        assert again.generate([prompt], params, use_tqdm=False)[0].token_ids == out.token_ids
        # a history longer than the one it was traced with: the blocks are a symbolic size
        long = list(range(1, 60)) * 4
        got = again.generate([long], dataclasses.replace(params, max_tokens=4), use_tqdm=False)[0]
        ref = llmlib.Generator(model, Tok()).generate(long, max_new_tokens=4, ignore_eos=True)
        assert got.token_ids == ref.token_ids


def test_the_key_follows_the_file_the_format_and_the_machines_choices(model_file, tmp_path):
    with forced(cache=tmp_path):
        a = aot.step_key(llmlib.load_model(model_file, "cpu", "float32"), "engine")
        b = aot.step_key(llmlib.load_model(model_file, "cpu", "float32", "int8"), "engine")
        with forced(paged_kernel=False):
            c = aot.step_key(llmlib.load_model(model_file, "cpu", "float32"), "engine")
        built = llmlib.model.random_model(TINY, "cpu")
        assert aot.step_key(built, "engine") is None  # nothing to find a built model by
        assert aot.file_digest(model_file) == aot.file_digest(model_file)  # remembered
        assert (tmp_path / "compiled" / "digests.json").exists()
    assert len({a, b, c}) == 3


def test_the_engines_step_compiled_once_then_loaded(model_file, tmp_path) -> None:
    """``LLM(compile=True)`` on a model from a file: the all-decode steps (every batch size and
    history length: one package) give the eager engine's tokens, and the next engine loads the
    package instead of compiling; ``LLM(path)`` does so by default, and so does the
    batch-invariant engine (:func:`_batch_invariant_groups_through_the_same_package`)."""
    prompts = [[3, 5, 7, 9][: 1 + i % 4] * (1 + i) for i in range(6)]
    params = llmlib.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=8)
    with forced(cache=tmp_path):
        model = llmlib.load_model(model_file, "cpu", "float32")
        want = [
            o.token_ids for o in llmlib.LLM(model, Tok(), **kw).generate(prompts, params, False)
        ]
        first = llmlib.LLM(model, Tok(), compile=True, **kw)
        assert first.runner.decode_path == "compiled (now, cached)"
        got = [o.token_ids for o in first.generate(prompts, params, use_tqdm=False)]
        assert got == want and first.runner.graphs.static_steps > 0
    # a path, with compile left out: compiled by default (LLMLIB_COMPILE unset), from the cache
    with forced(cache=tmp_path, compile_default=True):
        again = llmlib.LLM(model_file, Tok(), dtype="float32", **kw)
        assert again.runner.decode_path == "compiled (from the cache)"
        assert [o.token_ids for o in again.generate(prompts, params, use_tqdm=False)] == want
    with forced(cache=tmp_path, compile_default=False):  # LLMLIB_COMPILE=0
        assert llmlib.LLM(model_file, Tok(), dtype="float32", **kw).runner.decode_path == "eager"
    _batch_invariant_groups_through_the_same_package(model_file, tmp_path, prompts)


def _batch_invariant_groups_through_the_same_package(model_file, tmp_path, prompts) -> None:
    """``LLM(path, batch_invariant=True)`` compiles by default (where the CPU has AMX: forced
    here, so a run as another class checks the groups too), through the engine's own package
    (its groups are two fixed row counts of the same graph): it loads the package the default
    engine stored. A request's log-probabilities are bitwise the same alone and in a batch. A
    next turn (the prompt and its answer, continued) reads the same keys alone and after the
    first turn filled the prefix cache: the blocks holding the answer, computed in the generated
    tokens' groups, are not taken for the same tokens given as a prompt."""
    from llmlib.analysis.invariance import measure

    params = llmlib.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=8, dtype="float32")
    with forced(cache=tmp_path, compile_default=True, invariant_compile=True):
        first = llmlib.LLM(model_file, Tok(), batch_invariant=True, **kw)
        assert first.runner.decode_path == "compiled (from the cache)" and first.runner.rows
        assert len(list((tmp_path / "compiled").glob("engine-heads-bs4-*.pt2"))) == 1
        alone = first.generate(prompts[-1:], params, use_tqdm=False)[0]
        again = llmlib.LLM(model_file, Tok(), batch_invariant=True, **kw)
        batched = again.generate(prompts, params, use_tqdm=False)[-1]
        lp = [[e.logprob for e in r.outputs[0].logprobs] for r in (alone, batched)]
        assert batched.token_ids == alone.token_ids and lp[0] == lp[1]

        def make(**k):
            return llmlib.LLM(model_file, Tok(), batch_invariant=True, **{**kw, **k})

        for case, r in measure(make, prompts, 6, ("batch-4", "chunk-7")).items():
            assert r.identical_share == 1.0, case
        turn = [prompts[-1] + alone.token_ids + [3]]  # 19 tokens: blocks 3 and 4 hold the answer
        fresh = make().generate(turn, params, use_tqdm=False)[0]
        hits = again.block_manager.num_prefix_hit_blocks
        after = again.generate(turn, params, use_tqdm=False)[0]
        assert again.block_manager.num_prefix_hit_blocks - hits == 3  # the prompt's blocks only
        lp = [[e.logprob for e in r.outputs[0].logprobs] for r in (fresh, after)]
        assert after.token_ids == fresh.token_ids and lp[0] == lp[1]


def test_a_bfloat16_engine_step_is_frozen_into_its_package(
    model_file, tmp_path, monkeypatch, capfd
) -> None:
    """All-bfloat16 weights on the CPU: the package is frozen (inductor re-stores the matrices and
    picks its GEMMs, as the in-memory step does), holds those constants itself, and the next
    engine loads it; a quantized or float32 model's package stays code only. Inductor times its
    GEMMs quietly: none of its autotune tables reach standard error (a cache of inductor's own
    for this test, so the timings run here)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompts = [[3, 5, 7, 9][: 1 + i % 4] * (1 + i) for i in range(6)]
    params = llmlib.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=8)
    with forced(cache=tmp_path):
        assert not aot.freezes(llmlib.load_model(model_file, "cpu", "float32"))
        assert not aot.freezes(llmlib.load_model(model_file, "cpu", "bfloat16", "int8"))
        model = llmlib.load_model(model_file, "cpu", "bfloat16")
        assert aot.freezes(model)
        eager = llmlib.LLM(model, Tok(), **kw).generate(prompts, params, use_tqdm=False)
        first = llmlib.LLM(model, Tok(), compile=True, **kw)
        assert first.runner.decode_path == "compiled (now, cached)"
        assert len(list((tmp_path / "compiled").glob("engine-heads-bs4-frozen-*.pt2"))) == 1
        assert any((tmp_path / "inductor").iterdir())  # the GEMMs were timed in this test
        err = capfd.readouterr().err
        assert "AUTOTUNE" not in err and "Autotune Choices" not in err
        got = [o.token_ids for o in first.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for o, g in zip(eager, got) for a, b in zip(o.token_ids, g))
        # bfloat16: the graph's own GEMMs (prompt steps too, every token a row) round apart, and
        # one near tie flipped sends the rest of its sequence elsewhere
        assert same >= 0.8 * sum(len(g) for g in got)
        again = llmlib.LLM(
            llmlib.load_model(model_file, "cpu", "bfloat16"), Tok(), compile=True, **kw
        )
        assert again.runner.decode_path == "compiled (from the cache)"
        assert [o.token_ids for o in again.generate(prompts, params, use_tqdm=False)] == got


def test_a_step_that_cannot_be_packaged_is_not_tried_again(model_file, tmp_path) -> None:
    """A step export refuses compiles in memory, and the reason is kept beside the package's
    name: the next start goes straight to memory instead of failing the export again, and its
    log line says why and how to retry."""
    import torch

    calls: list[Path] = []

    def compile(path: Path) -> None:
        calls.append(path)
        raise RuntimeError("Constraints violated (rows)")

    with forced(cache=tmp_path):
        model = llmlib.load_model(model_file, "cpu", "float32")
        logs: list[str] = []
        for _ in range(2):
            got = aot.load_step(model, "probe", torch.nn.Identity(), compile, logs.append)
            assert got == (None, False)
        assert len(calls) == 1 and not calls[0].exists()
        assert "Constraints violated (rows)" in logs[-1] and "to retry" in logs[-1]
        calls[0].with_suffix(".failed").unlink()  # retried once the reason is removed
        aot.load_step(model, "probe", torch.nn.Identity(), compile, logs.append)
        assert len(calls) == 2
