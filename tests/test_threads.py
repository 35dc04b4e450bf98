"""Every C++ kernel gives the same bits on one thread and on two.

Each kernel splits its work with ``at::parallel_for`` into units that never share an output
(tiles of rows, sequences times KV heads), so the split must not change a bit. The unit tests
may run on one torch thread a worker (``make unit`` runs two pytest-xdist workers on two cores):
this file is where the split across threads is exercised, whatever the workers' setting.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from llmlib.kernels import integer, matvec, native
from llmlib.kernels import paged_attention as paged_kernel
from llmlib.kernels.flags import forced
from llmlib.model.norm import RMSNorm
from llmlib.quantize import GroupCodes, quantize_int4, quantize_int8


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _same_on_one_and_two(fn) -> None:
    with threads(1):
        one = fn()
    with threads(2):
        two = fn()
    assert torch.equal(one, two)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(not integer.available(), reason="the integer kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4", "int8 groups", "int8 k-quant"])
def test_integer_kernels(kind, dtype) -> None:
    w = _rand(512, 256) * 0.05  # eight tiles of 64 rows: work for both threads
    if kind == "int8":
        packed = integer.VnniInt8Weight(quantize_int8(w), dtype)
    elif kind == "int4":
        packed = integer.VnniInt4Weight(quantize_int4(w, 32), dtype)
    elif kind == "int8 groups":
        packed = integer.VnniInt8GroupWeight(quantize_int4(w, 32).widened(8, 16), dtype)
    else:  # scales as a float unit per 256 columns times an int8 step per group (Q6_K's)
        g = torch.Generator().manual_seed(5)
        q = torch.randint(0, 256, (512, 256), generator=g).to(torch.uint8)
        unit = (torch.rand(512, 1, generator=g) * 1e-3 + 1e-4).half().float()
        steps = torch.randint(-128, 128, (512, 16), generator=g).to(torch.int8)
        codes = GroupCodes(q, unit * steps.float(), torch.zeros(512, 16), 16, 8, unit, steps)
        packed = integer.VnniInt8GroupWeight(codes, dtype)
        assert packed.u.numel()
    for rows in (1, 5):
        x = _rand(rows, 256, seed=rows).to(dtype)
        _same_on_one_and_two(lambda x=x: packed.linear(x))


@pytest.mark.skipif(not native.has_avx2(), reason="no AVX2 or AVX-512: no kernel here")
def test_one_row_product() -> None:
    with forced(matvec=True):
        if not matvec.available():
            pytest.skip("the kernel could not be built here")
        w, x = _rand(1000, 576), _rand(1, 576, seed=1)
        _same_on_one_and_two(lambda: matvec.matvec(x, w))


def test_fused_norm() -> None:
    from llmlib.kernels import norm

    if not norm.available():
        pytest.skip("the fused norm does not run here")
    fused = norm.FusedRMSNorm.replacing(RMSNorm(576))
    x = _rand(64, 576)
    _same_on_one_and_two(lambda: fused(x))


@pytest.mark.skipif(not paged_kernel.available(), reason="the paged kernel does not run here")
def test_paged_decode_attention() -> None:
    n, heads, hkv, d, bs = 6, 12, 2, 64, 16
    lens = torch.tensor([1, 15, 16, 17, 40, 100])
    blocks = n * 7
    k, v = _rand(blocks, bs, hkv, d, seed=1), _rand(blocks, bs, hkv, d, seed=2)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(3)).view(n, 7)
    q = _rand(n, heads, d, seed=4)
    _same_on_one_and_two(lambda: paged_kernel.decode_attention(q, k, v, table, lens, window=30))
