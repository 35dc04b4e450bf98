"""llmlib.kernels.weights and prepare: each stored layout gives F.linear's numbers, a model's
state dict stays the plain weights, and the loader's choices follow the flags."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlib.config import ModelConfig
from llmlib.kernels import bfloat16, matvec
from llmlib.kernels.bfloat16 import Bfloat16Weight
from llmlib.kernels.flags import flags, forced
from llmlib.kernels.prepare import blocked_copies, prepare, weight_matrices
from llmlib.kernels.weights import Float32Weight
from llmlib.model import random_model

onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)
CFG = ModelConfig(
    name="tiny", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48
)


def _w(out_f: int = 96, in_f: int = 64) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0))


@onednn
@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64), (1, 64), (1, 1, 64)])
@pytest.mark.parametrize("one_row", [False, True])
def test_float32_layouts_equal_f_linear(shape, one_row):
    if one_row and not matvec.available():
        pytest.skip("the one-row kernel is not chosen or cannot build here")
    w, b = _w(), torch.randn(96)
    x = torch.randn(shape)
    for blocked in (False, True):
        stored = Float32Weight(w, one_row=one_row, blocked=blocked)
        torch.testing.assert_close(stored.linear(x, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    column_major = Float32Weight(w.t().contiguous().t(), blocked=True)  # MKL's decode layout
    torch.testing.assert_close(column_major.linear(x), x @ w.T, atol=1e-5, rtol=1e-5)


@onednn
def test_a_model_holds_float32_as_the_flags_say_and_saves_the_plain_weights():
    state = random_model(CFG).state_dict()
    ids = torch.randint(0, 64, (2, 9))
    ref = random_model(CFG)(ids)
    for copy in (False, True):
        with forced(onednn_float32=copy):
            model = prepare(random_model(CFG))
        mats = [m.weight for m in weight_matrices(model).values()]
        assert mats and all(isinstance(w, Float32Weight) for w in mats)
        assert all((w.blocked is not None) == copy for w in mats)
        torch.testing.assert_close(model(ids), ref, atol=1e-5, rtol=1e-5)
        # what a state dict hands out is the plain weights, under the contract's names
        out = model.state_dict()
        assert sorted(out) == sorted(state)
        assert all(torch.equal(out[k], state[k]) for k in state)
    # the bench's switch: the copy on and off on one model
    assert blocked_copies(model, False) == len(mats) and blocked_copies(model, False) == 0
    torch.testing.assert_close(model(ids), ref, atol=1e-5, rtol=1e-5)


def test_the_default_follows_the_cpu_vendor():
    """A float32 model keeps oneDNN's copy, and takes the one-row kernel, where MKL is slow: on
    CPUs not made by Intel."""
    f = flags()
    assert f.onednn_float32 == (not f.mkl_tuned)
    assert f.matvec == (not f.mkl_tuned and f.isa != "none")


def test_other_dtypes_stay_plain_where_onednn_cannot():
    with forced(onednn_bfloat16=False, bfloat16_widen=False):
        model = prepare(random_model(CFG, "cpu", torch.bfloat16))
    assert all(isinstance(m.weight, torch.Tensor) for m in weight_matrices(model).values())


@pytest.mark.parametrize("rows", [1, bfloat16.WIDEN_ROWS - 1, bfloat16.WIDEN_ROWS, 40])
def test_bfloat16_widened_for_several_rows(monkeypatch, rows):
    """A CPU without bfloat16 arithmetic: up to a few rows, PyTorch's bfloat16 product itself;
    from WIDEN_ROWS rows on, the matrix widened to float32 a slice at a time (here 10 rows of it
    per slice, the last one short), the same sums rounded to bfloat16 once."""
    monkeypatch.setattr(bfloat16, "WIDEN_SLICE", 10 * 64)
    w, b = _w().bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    stored = Bfloat16Weight(w)
    got = stored.linear(x, b)
    if rows < bfloat16.WIDEN_ROWS:
        assert torch.equal(got, F.linear(x, w, b))
    else:
        assert torch.equal(got, stored._mm(x) + b)
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(stored._mm(x).float() + b.float(), exact, atol=0.05, rtol=0.02)
    assert torch.equal(stored.rows(torch.tensor([3, 0])), w[[3, 0]])


def test_a_bfloat16_model_widens_where_the_flags_say_and_saves_the_plain_weights():
    plain = random_model(CFG, "cpu", torch.bfloat16)
    state = plain.state_dict()
    ids = torch.randint(0, 64, (2, 9))
    with forced(onednn_bfloat16=False, bfloat16_widen=True):
        model = prepare(random_model(CFG, "cpu", torch.bfloat16))
    mats = [m.weight for m in weight_matrices(model).values()]
    assert mats and all(isinstance(w, Bfloat16Weight) for w in mats)
    got, ref = model(ids).float(), plain(ids).float()
    assert (got - ref).abs().max() < 0.05 * ref.std(), (got - ref).abs().max()
    out = model.state_dict()
    assert sorted(out) == sorted(state) and all(torch.equal(out[k], state[k]) for k in state)
