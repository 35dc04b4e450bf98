"""The one-row float32 kernel equals the same product in float64, and linear() takes it only
where it serves (a one-row float32 product of a contiguous CPU matrix)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmlib.kernels import linear, matvec, native

can_build = native.has_avx2() or native.has_avx512()
needs_kernel = pytest.mark.skipif(not can_build, reason="no AVX2 or AVX-512: no kernel here")


@pytest.fixture
def forced_on(monkeypatch):
    monkeypatch.setenv("LLMLIB_MATVEC", "1")
    matvec.preferred.cache_clear()  # the answer is kept per process: read the variable again
    try:
        if not matvec.preferred():
            pytest.skip("the kernel could not be built here")
        yield
    finally:
        monkeypatch.undo()
        matvec.preferred.cache_clear()  # later tests see this machine's own choice


@needs_kernel
@pytest.mark.parametrize("shape", [(8, 16), (13, 48), (960, 576), (576, 1536), (1000, 64)])
def test_kernel_equals_float64(forced_on, shape) -> None:
    # 13 and 1000 rows: a remainder after the passes of eight rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    x = torch.randn(1, shape[1], generator=g)
    got = matvec.matvec(x, w)
    want = (x.double() @ w.double().T).float()
    assert got.shape == (1, shape[0])
    torch.testing.assert_close(got, want, atol=1e-5 * shape[1] ** 0.5, rtol=1e-5)


@needs_kernel
def test_linear_takes_it_for_one_row_only(forced_on, monkeypatch) -> None:
    calls = []
    real = matvec.matvec
    monkeypatch.setattr(matvec, "matvec", lambda x, w: calls.append(x.shape) or real(x, w))
    w, b = torch.randn(64, 32), torch.randn(64)
    one, two = torch.randn(1, 1, 32), torch.randn(2, 32)
    torch.testing.assert_close(linear.linear(one, w, b), one @ w.T + b)
    torch.testing.assert_close(linear.linear(two, w), two @ w.T)
    linear.linear(one, w.t().contiguous().t())  # column-major: MKL's
    linear.linear(one.bfloat16(), w.bfloat16())  # bfloat16: not this kernel's
    assert calls == [(1, 1, 32)]


def test_switched_off_and_refused() -> None:
    code = (
        "import torch; from llmlib.kernels import matvec; assert not matvec.preferred(); "
        "assert not matvec.serves(torch.zeros(4, 16))"
    )
    env = {**os.environ, "LLMLIB_MATVEC": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not matvec.serves(torch.zeros(4, 15))  # rows not a multiple of 16
    assert not matvec.serves(torch.zeros(4, 16, dtype=torch.bfloat16))


@needs_kernel
def test_errors_name_the_problem(forced_on) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.llmlib_matvec.matvec(torch.zeros(1, 15), torch.zeros(4, 15))
    with pytest.raises(RuntimeError, match="K = 16"):
        torch.ops.llmlib_matvec.matvec(torch.zeros(1, 8), torch.zeros(4, 16))


def test_loading_a_model_leaves_dynamo_unimported(smollm2_path, tmp_path) -> None:
    """A decorator from torch.compiler once imported dynamo with llmlib.kernels.matvec:
    in every process, which the bench's resident memory then counted as weights."""
    code = (
        "import sys, llmlib; llmlib.load_model(sys.argv[1], 'cpu', 'float32'); "
        "llmlib.load_model(sys.argv[1], 'cpu', 'bfloat16', 'int8'); "
        "assert 'torch._dynamo' not in sys.modules, 'loading imported torch._dynamo'"
    )
    subprocess.run([sys.executable, "-c", code, str(smollm2_path)], check=True, cwd=tmp_path)
