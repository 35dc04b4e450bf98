"""Model configurations: presets, validation, and reading Hugging Face config.json in both styles."""

from __future__ import annotations

import pytest

from llmlib.config import ModelConfig, RopeScaling, get_config


def test_presets_exist_with_published_shapes() -> None:
    for name in ("llama-3-70b", "llama-3.1-8b", "llama-3.2-1b", "smollm2-135m"):
        assert get_config(name).name == name
    c = get_config("llama-3-70b")
    assert (
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.ffn_dim,
        c.vocab_size,
    ) == (80, 8192, 64, 8, 128, 28672, 128256)
    s = get_config("smollm2-135m")
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim, s.gqa_group) == (
        30,
        576,
        9,
        3,
        64,
        1536,
        3,
    )


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama-3-70b"):
        get_config("gpt-5")


@pytest.mark.parametrize(
    "field,value", [("n_layers", 0), ("d_model", -1), ("n_kv_heads", 5), ("vocab_size", 1.5)]
)
def test_bad_config_values_are_rejected(field: str, value: object) -> None:
    kwargs = dict(
        name="x", vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128
    )
    kwargs[field] = value
    with pytest.raises(ValueError, match=field if field != "n_kv_heads" else "multiple"):
        ModelConfig(**kwargs)


BASE = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
L3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_hub_style_config_json() -> None:
    c = ModelConfig.from_hf_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": L3})
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert c.head_dim == 16 and c.tie_embeddings and c.norm_eps == 1e-6


def test_transformers5_style_config_json() -> None:
    c = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 250000.0, **L3}})
    assert c.rope_theta == 250000.0 and c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    plain = ModelConfig.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_unknown_architecture_and_scaling_are_rejected() -> None:
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
