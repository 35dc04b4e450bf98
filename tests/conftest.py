"""Shared fixtures: the real model's path, and markers.

`model` tests need SmolLM2's GGUF; the README's commands fetch it first (`llmlib fetch`), and the
fixture fetches it too (idempotently) so a single test file can be run on its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Engines and generators built from a path compile their CPU decode steps by default, a minute or
# more per model and format on a cold cache; the tests build dozens. Here the default is eager:
# compiled steps are tested where a test asks for them (compile=True: test_aot, test_engine,
# test_forced_paths), and the default itself under forced flags (test_compile_default).
os.environ.setdefault("LLMLIB_COMPILE", "0")
# Loads pack their weights: the cache of packed weights on disk is tested on its own
# (test_packed_cache), in a folder of its own, so the tests leave no gigabytes behind.
os.environ.setdefault("LLMLIB_PACKED_CACHE", "0")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from llmlib.checkpoints.fetch import fetch_model

    return fetch_model(quiet=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """transformers' own float32 model of the same GGUF file, the reference for logits, greedy
    tokens and perplexity; loaded once (its GGUF conversion is the slow part of those tests)."""
    transformers = pytest.importorskip("transformers")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture
def kwargs_of(monkeypatch):
    """``kwargs_of(module, name, run)``: call ``run()`` with ``module.name`` replaced by a stub that
    stops the call there, and return the keywords the stub was given (what a command hands on)."""

    class Stop(Exception):
        pass

    def capture(module, name: str, run) -> dict:
        seen: dict = {}

        def stub(*args, **kwargs):
            seen.update(kwargs)
            raise Stop

        monkeypatch.setattr(module, name, stub)
        with pytest.raises(Stop):
            run()
        return seen

    return capture


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker keeps to one torch thread: two workers then share the two
    cores instead of four threads fighting over them. The processes a test starts get one thread
    too, unless they ask for more (OMP_NUM_THREADS)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A command a test runs in-process (``--threads 2``) sets torch's threads for the whole
    worker; put it back, or every later test in that worker runs two threads beside the other
    worker's, and both slow down several times."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
