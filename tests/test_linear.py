"""llmlib.kernels.linear: the oneDNN-packed copy gives F.linear's numbers, and is never used once stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlib.kernels.linear import (
    is_packed,
    linear,
    onednn_float32_preferred,
    pack_weights,
    unpack_weights,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


def _layer(out_f: int = 96, in_f: int = 64) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False)


@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64), (1, 64)])
def test_packed_product_equals_f_linear(shape):
    lin = _layer()
    assert pack_weights(lin) == 1 and is_packed(lin.weight)
    x = torch.randn(shape)
    torch.testing.assert_close(linear(x, lin.weight), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)


def test_column_major_weight_packs_to_the_same_product():
    lin = _layer()
    lin.weight.data = lin.weight.data.t().contiguous().t()  # the matvec layout some matrices get
    pack_weights(lin)
    x = torch.randn(9, 64)
    torch.testing.assert_close(linear(x, lin.weight), x @ lin.weight.T, atol=1e-5, rtol=1e-5)


def test_a_changed_weight_is_never_multiplied_by_its_stale_copy():
    lin = _layer()
    pack_weights(lin)
    x = torch.randn(4, 64)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the version counter moves
    assert not is_packed(lin.weight)
    torch.testing.assert_close(linear(x, lin.weight), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
    lin.weight.data = torch.randn(96, 64)  # replaced: the pointer moves
    assert not is_packed(lin.weight)
    torch.testing.assert_close(linear(x, lin.weight), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
    # re-packs the stale one, then nothing to do
    assert pack_weights(lin) == 1 and pack_weights(lin) == 0


def test_other_dtypes_are_left_alone():
    lin = _layer().to(torch.bfloat16)
    assert pack_weights(lin) == 0 and not is_packed(lin.weight)


def test_built_cpu_model_holds_float32_once_and_a_copy_gives_the_same_logits():
    """The loader makes no oneDNN copy (weights held once); one added later changes nothing but
    the order of float32 sums."""
    from llmlib.checkpoints.build import build_model
    from llmlib.config import ModelConfig
    from llmlib.model import random_model

    cfg = ModelConfig(
        name="tiny",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        max_seq_len=64,
    )
    state = random_model(cfg).state_dict()
    model = build_model(cfg, dict(state), "cpu", torch.float32)
    mats = [p for p in model.parameters() if p.dim() == 2]
    # the loader makes the copy only where MKL is slow at several rows (not an Intel CPU)
    copied = onednn_float32_preferred()
    assert mats and all(is_packed(p) == copied for p in mats)
    ids = torch.randint(0, 64, (2, 9))
    if copied:
        unpack_weights(model)
    plain_logits = model(ids)
    assert pack_weights(model) == len(mats) and all(is_packed(p) for p in mats)
    torch.testing.assert_close(model(ids), plain_logits, atol=1e-5, rtol=1e-5)
    # what a state dict hands out is the plain weights, exactly as loaded
    out = model.state_dict()
    assert all(torch.equal(out[k], state[k]) for k in state)
