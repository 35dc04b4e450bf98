"""The fused CPU RMSNorm (llmlib/kernels/csrc/rms_norm.cpp) equals torch.nn.functional.rms_norm,
and the fused module uses it only where it may (eager, no autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlib.kernels import norm
from llmlib.kernels.flags import forced
from llmlib.model.norm import RMSNorm

needs_kernel = pytest.mark.skipif(
    not norm.available(), reason="no AVX-512 or no compiler: the fused norm cannot run here"
)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    mod = RMSNorm(w.shape[0], eps)
    mod.weight = torch.nn.Parameter(w, requires_grad=False)
    return norm.FusedRMSNorm.replacing(mod)(x)


@needs_kernel
@pytest.mark.parametrize(
    "xdt,wdt",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 64), (512, 576), (2, 40), (7, 1)])
def test_fused_norm_equals_pytorchs(xdt, wdt, shape) -> None:
    # widths that are and are not a multiple of 16 (the kernel's masked tail); many rows (threads)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(xdt)
    w = torch.randn(shape[-1], generator=g).to(wdt)
    with torch.no_grad():
        out = rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.float(), w.shape, w.float(), 1e-5).to(out.dtype)
    assert out.dtype == (torch.bfloat16 if xdt == torch.bfloat16 else torch.float32)
    if xdt == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
    else:  # one rounding to bfloat16 at the end: the same value or the neighbouring one
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2**-7 + 1e-30).all()


@needs_kernel
def test_nan_and_strided_inputs() -> None:
    x = torch.randn(4, 32)[:, ::2]  # not contiguous
    w = torch.ones(16)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))
        x = torch.randn(2, 32).bfloat16()
        x[0, 3] = float("nan")
        out = rms_norm(x, torch.ones(32).bfloat16(), 1e-6)
    assert out[0].isnan().all() and not out[1].isnan().any()


@needs_kernel
def test_module_keeps_autograd() -> None:
    # the gain is a parameter that wants gradients: PyTorch's differentiable op runs then
    mod = norm.FusedRMSNorm.replacing(RMSNorm(64))
    x = torch.randn(2, 64, requires_grad=True)
    y = mod(x)
    y.sum().backward()
    assert x.grad is not None and mod.weight.grad is not None
    with torch.no_grad():  # the fused kernel: the same numbers
        torch.testing.assert_close(mod(x), y.detach(), atol=1e-6, rtol=0)


def test_switched_off() -> None:
    with forced(fused_norm=False):
        assert not norm.available()
