"""RoPE: tables against transformers, the relative-position property, the two layouts' equivalence,
and Llama-3 frequency scaling."""

from __future__ import annotations

import pytest
import torch

from llmlib.config import ModelConfig, RopeScaling
from llmlib.model.rope import (
    RotaryTables,
    apply_rope,
    apply_rope_interleaved,
    apply_rope_layout,
    interleaved_to_split_half_perm,
    permute_heads,
    rope_inv_freq,
)

SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


@pytest.mark.parametrize("scaling", [None, SCALING])
def test_tables_match_transformers(scaling: RopeScaling | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = {"rope_theta": 500_000.0}
    if scaling:
        kw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=20_000, **kw
    )
    hf = LlamaRotaryEmbedding(hf_cfg)
    pos = torch.tensor([[0, 1, 7, 100, 9000, 19_999]])
    cos_ref, sin_ref = hf(torch.zeros(1), pos)
    tables = RotaryTables(128, 20_000, 500_000.0, scaling)
    cos, sin = tables(pos, torch.float32)
    torch.testing.assert_close(cos[:, 0], cos_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], sin_ref, atol=1e-6, rtol=0)


def test_llama3_scaling_bands() -> None:
    base = rope_inv_freq(128, 500_000.0)
    scaled = rope_inv_freq(128, 500_000.0, SCALING)
    wavelen = 2 * torch.pi / base
    short = wavelen < 8192 / 4
    long = wavelen > 8192 / 1
    assert torch.equal(scaled[short], base[short])  # fast pairs untouched
    torch.testing.assert_close(scaled[long], base[long] / 8)  # slow pairs stretched by the factor
    mid = ~short & ~long
    assert mid.any() and ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()


def test_score_depends_only_on_distance() -> None:
    hd = 32
    tables = RotaryTables(hd, 512, 10_000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)

    def score(m: int, n: int) -> float:
        cos, sin = tables(torch.tensor([[m, n]]), torch.float32)
        r = apply_rope(torch.stack([q, k])[None, None], cos, sin)[0, 0]
        return float(r[0] @ r[1])

    for shift in (1, 17, 300):
        assert score(5, 2) == pytest.approx(score(5 + shift, 2 + shift), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)


def test_rotation_preserves_norm_and_position_zero_is_identity() -> None:
    tables = RotaryTables(16, 64, 10_000.0)
    x = torch.randn(2, 3, 5, 16)
    cos, sin = tables(torch.tensor([[0, 3, 9, 40, 63]] * 2), torch.float32)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_layouts_are_equivalent_under_permutation() -> None:
    hd, H = 16, 3
    tables = RotaryTables(hd, 64, 10_000.0)
    perm = interleaved_to_split_half_perm(hd)
    x = torch.randn(1, H, 7, hd)  # head vectors in the interleaved convention
    cos, sin = tables(torch.arange(7)[None] + 4, torch.float32)
    a = apply_rope_interleaved(x, cos, sin)[..., perm]
    b = apply_rope(x[..., perm], cos, sin)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(
        apply_rope_layout(x, cos, sin, "interleaved"), apply_rope_interleaved(x, cos, sin)
    )
    # the same permutation applied to the rows of a projection matrix, head by head
    w = torch.randn(H * hd, 10)
    inp = torch.randn(10)
    torch.testing.assert_close(
        (permute_heads(w, H, perm) @ inp).view(H, hd), (w @ inp).view(H, hd)[:, perm]
    )
    with pytest.raises(ValueError, match="layout"):
        apply_rope_layout(x, cos, sin, "sideways")


def test_arbitrary_positions_per_row() -> None:
    cfg = ModelConfig(
        name="t",
        vocab_size=10,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=8,
        max_seq_len=128,
    )
    tables = RotaryTables.from_config(cfg)
    x = torch.randn(2, 2, 3, 16)
    pos = torch.tensor([[0, 1, 2], [50, 51, 90]])
    cos, sin = tables(pos, torch.float32)
    y = apply_rope(x, cos, sin)
    for b in range(2):
        c1, s1 = tables(pos[b : b + 1], torch.float32)
        torch.testing.assert_close(y[b : b + 1], apply_rope(x[b : b + 1], c1, s1))


def test_odd_head_dim_rejected() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(15, 10_000.0)
