"""Shared fixtures: the real model's path, and markers.

`model` tests need SmolLM2's GGUF; the README's commands fetch it first (`llmlib fetch`), and the
fixture fetches it too (idempotently) so a single test file can be run on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from llmlib.checkpoints.fetch import fetch_model

    return fetch_model(quiet=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
