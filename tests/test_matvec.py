"""The one-row float32 kernel equals the same product in float64, and a float32 matrix takes it
only where it serves (one row, float32, a contiguous CPU matrix, the flags choosing it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmlib.kernels import matvec, native
from llmlib.kernels.flags import forced
from llmlib.kernels.weights import Float32Weight


@pytest.fixture
def forced_on():
    if not native.has_avx2():
        pytest.skip("no AVX2 or AVX-512: no kernel here")
    with forced(matvec=True):
        if not matvec.available():
            pytest.skip("the kernel could not be built here")
        yield


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


def test_a_float32_matrix_takes_it_for_one_row_only(forced_on, monkeypatch) -> None:
    calls = []
    real = torch.ops.llmlib_matvec.matvec

    class Spy:
        @staticmethod
        def matvec(x, w):
            calls.append(tuple(x.shape))
            return real(x, w)

    monkeypatch.setattr(torch.ops, "llmlib_matvec", Spy)
    w, b = torch.randn(64, 32), torch.randn(64)
    stored = Float32Weight(w, one_row=matvec.serves(w))
    one, two = torch.randn(1, 1, 32), torch.randn(2, 32)
    torch.testing.assert_close(stored.linear(one, b), one @ w.T + b)
    torch.testing.assert_close(stored.linear(two), two @ w.T)
    stored.linear(one.bfloat16().float())  # another float32 row: the kernel again
    assert calls == [(1, 1, 32), (1, 1, 32)]
    assert not matvec.serves(w.t().contiguous().t())  # column-major: MKL's layout


def test_switched_off_and_refused() -> None:
    code = (
        "import torch; from llmlib.kernels import matvec; assert not matvec.available(); "
        "assert not matvec.serves(torch.zeros(4, 16))"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={"LLMLIB_MATVEC": "0", "PATH": "/usr/bin"}
    )
    assert not matvec.serves(torch.zeros(4, 15))  # rows not a multiple of 16
    assert not matvec.serves(torch.zeros(4, 16, dtype=torch.bfloat16))


def test_errors_name_the_problem(forced_on) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.llmlib_matvec.matvec(torch.zeros(1, 15), torch.zeros(4, 15))
    with pytest.raises(RuntimeError, match="K = 16"):
        torch.ops.llmlib_matvec.matvec(torch.zeros(1, 8), torch.zeros(4, 16))


@pytest.mark.skipif(not native.has_avx2(), reason="no AVX2 or AVX-512: no kernel here")
def test_a_finished_build_is_loaded_without_the_build_tool(monkeypatch) -> None:
    """A kernel built once on this machine is found by its source and flags and loaded as it
    is: cpp_extension (and its ninja, which rebuilds whenever the checkout's path changed) is
    not called. Another source or other flags name another build."""
    from torch.utils import cpp_extension

    which = "avx512" if native.has_avx512() else "avx2"
    args = ("llmlib_matvec_" + which, "matvec.cpp", native.flags_for(which))
    assert native.build(*args, "one-row float32 kernel")  # built here (once per machine)
    assert native.cached(*args)

    def refuse(**kw):
        raise AssertionError("cpp_extension.load called for a finished build")

    monkeypatch.setattr(cpp_extension, "load", refuse)
    assert native.build(*args, "one-row float32 kernel")
    assert not native.cached(args[0], args[1], [*args[2], "-DLLMLIB_OTHER"])


def test_loading_a_model_leaves_dynamo_unimported(smollm2_path, tmp_path) -> None:
    """Nothing on the loading path imports torch._dynamo: in every process, the bench's resident
    memory would count it as weights."""
    code = (
        "import sys, llmlib; llmlib.load_model(sys.argv[1], 'cpu', 'float32'); "
        "llmlib.load_model(sys.argv[1], 'cpu', 'bfloat16', 'int8'); "
        "assert 'torch._dynamo' not in sys.modules, 'loading imported torch._dynamo'"
    )
    subprocess.run([sys.executable, "-c", code, str(smollm2_path)], check=True, cwd=tmp_path)
