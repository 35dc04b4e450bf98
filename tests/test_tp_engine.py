"""The batching engine split over processes (gloo on the CPU) gives the unsplit engine's logits
and tokens, returns every KV block on every rank, holds a shard's worth of weights per rank, and
fails loudly, never hanging: a split the model cannot take, a port already taken, a worker that
dies at start-up or mid-run. ``torchrun`` starts the same ranks through the same code.

Every test here has a deadline (faulthandler kills the run with a traceback if one hangs).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import llmlib
from llmlib.checkpoints.save import save_hf_folder
from llmlib.config import ModelConfig
from llmlib.model import random_model
from llmlib.parallel.driver import TPOptions
from llmlib.parallel.group import TensorParallelError

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(
    name="tiny-gqa",
    vocab_size=300,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=128,
)
GREEDY = llmlib.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
    [40, 41],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 31],  # a shared prefix
    [99],
    list(range(100, 140)),  # longer than the step budget: chunked prefill
    [7, 7, 7, 7, 7, 7, 7],
]
# float32 on both sides: the comparison is of the split, not of a format
ENGINE = dict(
    num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=6, dtype="float32"
)


@pytest.fixture(autouse=True)
def deadline():
    """No test here may hang: after 90 s the process dumps every thread's stack and exits."""
    faulthandler.dump_traceback_later(90, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    assert not dist.is_initialized(), "a test left torch.distributed initialised"


def _checkpoint(folder: Path, tied: bool) -> Path:
    cfg = CFG.replace(name=f"tiny-{'tied' if tied else 'untied'}", tie_embeddings=tied)
    return save_hf_folder(random_model(cfg, "cpu", torch.float32, seed=7, std=0.15), folder)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("untied"), tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("tied"), tied=True)


def _record_logits(llm: llmlib.LLM) -> list[torch.Tensor]:
    """Every forward pass's logits, as the engine sees them before sampling."""
    seen: list[torch.Tensor] = []
    forward = llm.runner._forward

    def spy(chunks, select):
        out = forward(chunks, select)
        seen.append(out.detach().clone())
        return out

    llm.runner._forward = spy
    return seen


def _run(llm: llmlib.LLM, prompts=PROMPTS, params=GREEDY, check_blocks: bool = False):
    """Generate step by step; with ``check_blocks``, after every step each rank's view of the
    blocks in use must be the block manager's."""
    for p in prompts:
        llm.add_request(p, params)
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        if check_blocks:
            used = llm.block_manager.num_used_blocks
            assert [r.held_blocks for r in llm.tensor_parallel_report()] == [used] * 2
    return [outs[k] for k in sorted(outs, key=lambda k: int(k.split("-")[1]))]


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_tp2_equals_tp1(which: str, request) -> None:
    """TP = 2 on a GQA model: every step's logits within 1e-5 of TP = 1 (float32), the same
    greedy tokens over mixed prompts (a shared prefix, chunked prefill, preemption), every KV
    block back on every rank, and a shard's worth of weights on each."""
    path = request.getfixturevalue(which)
    ref = llmlib.LLM(path, **ENGINE)
    ref_logits = _record_logits(ref)
    ref_tokens = _run(ref)
    assert ref.stats().preemptions > 0  # the pool is small on purpose
    with llmlib.LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        logits = _record_logits(llm)
        tokens = _run(llm, check_blocks=which == "untied")
        assert tokens == ref_tokens
        assert llm.stats().preemptions == ref.stats().preemptions
        assert len(logits) == len(ref_logits)
        worst = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
        assert worst < 1e-5
        reports = llm.tensor_parallel_report()
        assert llm.block_manager.num_used_blocks == 0
        for r in reports:
            assert r.num_blocks == ENGINE["num_blocks"] and r.held_blocks == 0
            assert r.live_sequences == 0
            assert r.weight_bytes == r.shard_bytes
            assert r.weight_bytes <= 1.1 * r.model_bytes / 2 + r.replicated_bytes
            assert r.weight_bytes >= 0.9 * r.model_bytes / 2
            assert r.allreduce_calls == r.steps * (1 + 2 * CFG.n_layers)
        # each rank's pool holds its own KV head of the two
        assert reports[0].pool_bytes == ref.kv_cache_bytes // 2
        # rank 0's shard alone would wait for ranks that are not running it: refused at once
        with pytest.raises(RuntimeError, match="one rank's shard"):
            llm.model(torch.tensor([[1, 2, 3]]))
        assert _run(llm, PROMPTS[:2]) == ref_tokens[:2]  # and the group is still in step
        pids = llm._tp.pids
    time.sleep(0.1)
    for pid in pids.values():
        if pid != os.getpid():
            assert not _alive(pid), f"rank process {pid} outlived shutdown()"


def test_n_choices_fork_their_blocks_on_every_rank(untied: Path) -> None:
    """n > 1 under TP: the forked sequence's copy-on-write block is copied in every rank's pool
    (each holds its own KV heads), so greedy choices all equal the single choice of TP = 1."""
    prompt = PROMPTS[0][:18]  # 18 tokens in blocks of 4: the last block is partial, so it is copied
    one = llmlib.LLM(untied, **ENGINE).generate([prompt], GREEDY, use_tqdm=False)[0]
    with llmlib.LLM(untied, tensor_parallel_size=2, **ENGINE) as llm:
        (out,) = llm.generate(
            [prompt],
            llmlib.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3),
            use_tqdm=False,
        )
        assert [c.token_ids for c in out.outputs] == [one.token_ids] * 3
        assert all(r.held_blocks == 0 for r in llm.tensor_parallel_report())


def test_the_async_engine_runs_split_and_stops_its_ranks(untied: Path) -> None:
    """The server's engine (AsyncLLM, stepping in its own thread beside the heartbeat) on two
    ranks: the same tokens, and shutdown() stops the worker it started."""
    import asyncio

    from llmlib.engine import AsyncLLM

    ref = llmlib.LLM(untied, **ENGINE).generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    engine = AsyncLLM(str(untied), tensor_parallel_size=2, **ENGINE).start()
    pid = engine.llm._tp.pids[1]
    try:
        out = asyncio.run(engine.generate(PROMPTS[0], GREEDY))
    finally:
        engine.shutdown()
    assert out.token_ids == ref[0].token_ids
    time.sleep(0.1)
    assert not _alive(pid)


@pytest.mark.model
def test_smollm2_tp3_equals_tp1(smollm2_path: Path) -> None:
    """SmolLM2 (9 query, 3 KV heads) on three processes: greedy tokens identical to one, and
    every step's logits within 1e-5 of the largest logit. (An absolute 1e-5 is below this
    model's own float32 rounding: the unsplit model's float32 logits already differ from its
    float64 ones, and from a shorter batch's, by more than that; the random models above meet
    it.)"""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    params = llmlib.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=16, block_size=16, dtype="float32")
    ref = llmlib.LLM(smollm2_path, **kw)
    ref_logits = _record_logits(ref)
    ref_out = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    del ref
    with llmlib.LLM(smollm2_path, tensor_parallel_size=3, **kw) as llm:
        logits = _record_logits(llm)
        out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        reports = llm.tensor_parallel_report()
    assert out == ref_out
    assert len(logits) == len(ref_logits)
    worst = max(
        (a - b).abs().max().item() / b.abs().max().item() for a, b in zip(logits, ref_logits)
    )
    assert worst < 1e-5, worst
    assert [r.held_blocks for r in reports] == [0, 0, 0]
    for r in reports:
        assert r.weight_bytes == r.shard_bytes <= 1.1 * r.model_bytes / 3 + r.replicated_bytes


# ---- refusals and failures: every one an exception within seconds ---------------------------------


def test_a_split_the_heads_cannot_take_is_refused_at_once(smollm2_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="9 query heads do not split over 2"):
        llmlib.LLM(smollm2_path, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 5


def test_a_port_already_taken_is_refused(untied: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(
            TensorParallelError, match=f"port {port} on 127.0.0.1 is already in use"
        ):
            llmlib.LLM(untied, tensor_parallel_size=2, tp_options=TPOptions(port=port))
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("reader", ["prompt", "late"])
def test_a_worker_that_dies_at_startup_is_named(
    untied: Path, tmp_path: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot start (here its interpreter raises before llmlib runs): the driver
    names the rank, says how it ended and shows its last output. ``late``: the thread that
    reads the worker's output lags behind its exit (as on a loaded machine, where this once
    showed '(no output)'), and the message must still carry the output."""
    if reader == "late":
        from llmlib.parallel import group

        read = group.LocalWorker._read

        def late(self: group.LocalWorker) -> None:
            time.sleep(0.5)
            read(self)

        monkeypatch.setattr(group.LocalWorker, "_read", late)
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('RANK') == '1':\n"
        "    sys.stderr.write('rank 1 cannot start here\\n')\n"
        "    raise SystemExit(3)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as e:
        llmlib.LLM(untied, tensor_parallel_size=2, tp_options=TPOptions(worker_env=env))
    msg = str(e.value)
    assert "rank 1" in msg and "exited with code" in msg and "rank 1 cannot start here" in msg
    assert time.monotonic() - t0 < 30


def test_a_worker_killed_mid_run_is_named_and_the_rest_stop(untied: Path) -> None:
    llm = llmlib.LLM(untied, tensor_parallel_size=2, **ENGINE)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    pid = llm._tp.pids[1]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError):  # the engine stays failed, saying why
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()


def test_a_worker_error_is_reported_with_its_reason(untied: Path) -> None:
    """A worker that raises (here: a command it does not know, as from a mismatched version)
    leaves its error for the driver, which names the rank and the exception."""
    from llmlib.parallel import plan as P

    llm = llmlib.LLM(untied, tensor_parallel_size=2, **ENGINE)
    group = llm._tp.rank.groups.control
    dist.broadcast(P.pack([99, 0, 0]), 0, group=group)  # what a worker of another version sees
    with pytest.raises(TensorParallelError, match=r"rank 1 .*ValueError: unknown command 99"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


# ---- torchrun ----------------------------------------------------------------------------------------


def test_torchrun_launches_the_same_ranks(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m llmlib generate ... --tensor-parallel-size 2`` on this
    machine: rank 0 prints what the unsplit engine generates."""
    tok = llmlib.train_bpe("the cat sat on the mat. " * 40, vocab_size=280, progress=False)
    cfg = CFG.replace(vocab_size=tok.vocab_size)
    folder = save_hf_folder(random_model(cfg, "cpu", torch.float32, seed=8, std=0.3), tmp_path)
    tok.save(str(folder / "tokenizer.json"))
    args = ["--model", str(folder), "--no-chat", "--max-new-tokens", "8", "--quiet", "the cat"]
    ref = llmlib.LLM(folder, **ENGINE)
    want = ref.generate(["the cat"], llmlib.SamplingParams(max_tokens=8, temperature=0))[0].text
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "llmlib", "generate", "--tensor-parallel-size", "2", "--no-stream", *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == want.strip()


def test_quantization_with_tp_is_refused_before_any_rank_starts(untied) -> None:
    with pytest.raises(ValueError, match="quantization='int8' with tensor_parallel_size=2"):
        llmlib.LLM(untied, tensor_parallel_size=2, quantization="int8")
