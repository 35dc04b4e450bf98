"""The CUDA steps, checked without a GPU.

A GPU is lent to this project for minutes at a time, so what can be checked before it must be.
The meta device has shapes and dtypes but no data: a step traced on it runs every operator's
shape rule, so a wrong shape, a wrong dtype or a CPU tensor leaking into the step fails here.
Meta tensors take the GPU's route through the engine (the Triton paged kernel included), and
:class:`~llmlib.runtime.graphs.HostSyncCheck`, the check every CUDA capture's first warm-up
runs under, fails on anything a graph cannot replay: a value read back to the host, a copy
between host and device, a host tensor mixed into the device's work.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from llmlib.config import get_config
from llmlib.engine.fixed_step import bucket
from llmlib.engine.paged_cache import SeqChunk
from llmlib.engine.run_mode import capture_refused
from llmlib.engine.runner import ModelRunner
from llmlib.model.transformer import Transformer
from llmlib.runtime.graphs import HostSyncCheck, HostSyncError

# the paged kernel's shape rule runs on the meta device (triton itself is imported only when a
# test runs: test_paged_triton.py must import it first, under its interpreter, on a CPU)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (the test extra)"
)

#: gpu_check's engine setting: 256 sequences a step, 2,048 tokens of history (128 blocks of 16)
MAX_ROWS, MAX_LEN, BS = 256, 2048, 16


def meta_model(preset: str) -> Transformer:
    """A preset's model on the meta device, in bfloat16: the shapes of the real one, no memory."""
    model = Transformer(get_config(preset), device="meta").to(torch.bfloat16)
    model.reset_rotary("meta")  # the cos/sin tables, on the model's device as a load puts them
    return model.eval()


def meta_runner(preset: str) -> ModelRunner:
    """The engine's runner for the preset on fixed-shape steps: what CUDA graphs capture."""
    blocks = MAX_ROWS * MAX_LEN // BS
    return ModelRunner(
        meta_model(preset), blocks, BS, mode="fixed", max_rows=MAX_ROWS, max_model_len=MAX_LEN
    )


def decode_chunks(rows: int, blocks: int) -> list[SeqChunk]:
    """``rows`` decoding sequences, the longest of them ``blocks`` blocks into its history."""
    table = list(range(blocks))
    return [SeqChunk(table, max(0, blocks * BS - 1 - i % BS), 1) for i in range(rows)]


def traced(steps, chunks: list[SeqChunk]) -> torch.Tensor:
    """One decode step as a CUDA graph's capture runs it: the inputs written into the step's
    buffers first (outside the graph), then the forward pass alone under the check."""
    step = steps.steps.entry(steps.key(chunks))[0]
    step.fill(chunks, [1] * len(chunks))
    with HostSyncCheck():
        return steps.steps.forward(step)


def test_the_8b_steps_trace_on_the_meta_device_for_every_bucket() -> None:
    """Every row bucket (one sequence, the batch-1 step, up to 256) and every block bucket of
    the 8B preset's fixed-shape decode step, in bfloat16, runs on the meta device under the
    host-sync check, through the paged Triton kernel, and gives ``[rows, vocab]`` bfloat16
    logits on the model's device."""
    runner = meta_runner("llama-3.1-8b")
    steps, vocab = runner.graphs, runner.model.config.vocab_size
    assert runner.cache.kernel and not steps.masked  # the kernel serves every layer
    assert steps.max_rows == MAX_ROWS and steps.max_blocks == MAX_LEN // BS
    rows = sorted({bucket(n, MAX_ROWS) for n in range(1, MAX_ROWS + 1)})
    blocks = sorted({bucket(n, MAX_LEN // BS) for n in range(1, MAX_LEN // BS + 1)})
    shapes = {(r, blocks[-1]) for r in rows} | {(rows[0], b) for b in blocks}
    assert len(shapes) == len(rows) + len(blocks) - 1 == 16
    with torch.inference_mode():
        for r, b in sorted(shapes):
            chunks = decode_chunks(r, b)
            assert steps.fits(chunks) and steps.key(chunks) == (r, b)
            logits = traced(steps, chunks)
            assert logits.shape == (r, vocab), (r, b)
            assert logits.dtype == torch.bfloat16 and logits.device.type == "meta"
    assert len(steps.steps.entries) == len(shapes)


def test_a_mixture_of_experts_step_is_refused_a_graph_for_its_host_read() -> None:
    """Mixtral's routing asks the host which experts to run: traced at the 8x7B shapes the
    check names that read, and the engine refuses it CUDA graphs, saying why."""
    runner = meta_runner("mixtral-8x7b")
    chunks = decode_chunks(4, 8)
    with torch.inference_mode(), pytest.raises(HostSyncError, match="unique"):
        traced(runner.graphs, chunks)
    assert "mixture-of-experts" in capture_refused(runner.model)
    assert capture_refused(meta_model("llama-3.1-8b")) is None


@pytest.mark.parametrize(
    "step, named",
    [
        (lambda x: x.sum().item(), "item"),
        (lambda x: x.tolist(), "copy meta to cpu|item"),
        (lambda x: torch.where(x > 0), "nonzero"),
        (lambda x: x[x > 0], "boolean-mask index"),
        (lambda x: x.index_put_((x > 0,), torch.zeros((), device="meta")), "boolean-mask index"),
        (lambda x: x.unique(), "unique"),
        (lambda x: x.to("cpu"), "copy"),
        (lambda x: x + torch.ones(4), "mixes CPU tensors"),
        (lambda x: x * torch.tensor(2.0), "mixes CPU tensors"),
        (lambda x: x.copy_(torch.ones(4)), "mixes CPU tensors"),
    ],
)
def test_the_check_names_each_kind_of_host_sync(step, named) -> None:
    """Each way a step can wait for the host, or read it once at capture, fails under the
    check and is named; Python numbers and tensors made on the device pass."""
    x = torch.ones(4, device="meta")
    with pytest.raises(HostSyncError, match=named), HostSyncCheck():
        step(x)
    with HostSyncCheck():
        y = x * 2.0 + torch.arange(4, device="meta")
        torch.ones(4).sum().item()  # the CPU alone: no device waits
    assert y.device.type == "meta"
