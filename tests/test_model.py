"""llmlib's Transformer against Hugging Face transformers on random weights, the KV-cache hook, and
the loader's strictness. All models are tiny so the whole file runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmlib.checkpoints.build import load_model
from llmlib.config import ModelConfig
from llmlib.model import Transformer
from llmlib.model.attention import KVCacheLike
from llmlib.shapes import param_shapes as expected_shapes

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _perturb_norms(model: torch.nn.Module) -> None:
    """HF initialises every norm gain to 1, which would hide a norm that is applied to the wrong
    tensor; random gains make each one matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _save_llama(folder: Path, **kw) -> transformers.LlamaForCausalLM:
    base = dict(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
    )
    shard = kw.pop("_shard", "10GB")
    base.update(kw)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    _perturb_norms(hf)
    hf.save_pretrained(folder, max_shard_size=shard)
    return hf


def _compare(hf: torch.nn.Module, folder: Path, T: int = 40, B: int = 2) -> float:
    ours = load_model(folder, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    diff = (got - ref).abs().max().item()
    assert diff < TOL, diff
    assert ref.std() > 0.1  # the comparison is not between two near-constant outputs
    return diff


LLAMA_SHAPES = {
    # GQA ratio 1 (plain multi-head), tied embeddings
    "mha-tied": dict(
        num_attention_heads=4, num_key_value_heads=4, hidden_size=32, tie_word_embeddings=True
    ),
    # ratio 3, untied, Llama-3 frequency scaling exercised past original_max_position_embeddings
    "gqa3-llama3": dict(
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # ratio 8, one KV head, large theta, head_dim not equal to d_model / n_heads
    "gqa8-headdim": dict(
        num_attention_heads=8,
        num_key_value_heads=1,
        hidden_size=40,
        head_dim=12,
        rope_theta=500_000.0,
        rms_norm_eps=1e-4,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("name", sorted(LLAMA_SHAPES))
def test_llama_logits_match_transformers(tmp_path: Path, name: str) -> None:
    hf = _save_llama(tmp_path, **LLAMA_SHAPES[name])
    _compare(hf, tmp_path)


def test_llama3_scaling_is_read(tmp_path: Path) -> None:
    _save_llama(tmp_path, **LLAMA_SHAPES["gqa3-llama3"])
    cfg = load_model(tmp_path, device="cpu").config
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.norm_eps == 1e-6 and cfg.n_heads // cfg.n_kv_heads == 3


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = _save_llama(tmp_path, _shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _compare(hf, tmp_path)


def test_mixtral_logits_match_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    hf = transformers.MixtralForCausalLM(cfg).eval()
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    _compare(hf, tmp_path)
    assert load_model(tmp_path, device="cpu").config.n_experts == 4


def test_state_dict_uses_contract_names_and_round_trips() -> None:
    cfg = ModelConfig(
        name="t",
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        n_experts=3,
        n_experts_per_token=2,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    a = Transformer(cfg).eval()
    sd = a.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_shapes(cfg)
    b = Transformer(cfg).eval()
    b.load_state_dict(sd)
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


class ListCache(KVCacheLike):
    """The smallest cache that satisfies the contract: append new k/v per layer, mask by position
    (the contract's default ``attend`` does the rest)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.calls: list[int] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.calls.append(layer)
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        key_pos = torch.arange(k.shape[2])
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        return k, v, mask


@pytest.mark.parametrize("backend", ["sdpa", "naive", "tiled"])
def test_cache_hook_prefill_then_decode_equals_no_cache(backend: str) -> None:
    cfg = ModelConfig(
        name="t",
        vocab_size=64,
        d_model=48,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval().set_attention_backend(backend)
    ids = torch.randint(0, 64, (2, 14))
    cache = ListCache()
    with torch.no_grad():
        full = model(ids)
        parts = [model(ids[:, :9], positions=torch.arange(9).expand(2, 9), cache=cache)]
        for t in range(9, 14):
            parts.append(model(ids[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache))
        last = model(ids[:, :9], last_only=True)
    assert cache.calls[: cfg.n_layers] == list(range(cfg.n_layers))
    assert cache.k[0].shape == (2, cfg.n_kv_heads, 14, cfg.head_dim)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(last[:, 0], full[:, 8], atol=1e-5, rtol=0)


def test_cache_mask_none_means_causal() -> None:
    class PassThrough(KVCacheLike):
        def update(self, layer, k, v, positions):
            return k, v, None

    cfg = ModelConfig(
        name="t",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=48,
        max_seq_len=32,
    )
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cache=PassThrough()), model(ids), atol=1e-6, rtol=0)


def test_bfloat16_forward_runs() -> None:
    cfg = ModelConfig(
        name="t",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        max_seq_len=32,
    )
    model = Transformer(cfg).eval()
    ref = model(torch.arange(10)[None]).detach()
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        out = model(torch.arange(10)[None])
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1


# ---- bad input ---------------------------------------------------------------------------


@pytest.fixture()
def llama_folder(tmp_path: Path) -> Path:
    _save_llama(tmp_path, tie_word_embeddings=False)
    return tmp_path


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(llama_folder: Path) -> None:
    _rewrite(llama_folder, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.attn\.wk\.weight'"):
        load_model(llama_folder, device="cpu")


def test_extra_tensor_is_named(llama_folder: Path) -> None:
    _rewrite(
        llama_folder,
        lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(48)),
    )
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        load_model(llama_folder, device="cpu")


def test_extra_layer_is_named(llama_folder: Path) -> None:
    _rewrite(
        llama_folder,
        lambda sd: sd.__setitem__("model.layers.2.input_layernorm.weight", torch.ones(48)),
    )
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers\.2\.attn_norm\.weight'"):
        load_model(llama_folder, device="cpu")


def test_shape_mismatch_is_named(llama_folder: Path) -> None:
    cfg_path = llama_folder / "config.json"
    d = json.loads(cfg_path.read_text())
    d["intermediate_size"] = 80
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(
        ValueError, match=r"tensor 'layers\.0\.ffn\.w_gate\.weight' has shape \(72, 48\)"
    ):
        load_model(llama_folder, device="cpu")


def test_unknown_model_type(llama_folder: Path) -> None:
    cfg_path = llama_folder / "config.json"
    d = json.loads(cfg_path.read_text())
    d["model_type"] = "gpt2"
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(llama_folder, device="cpu")


def test_missing_config_field_is_named(llama_folder: Path) -> None:
    cfg_path = llama_folder / "config.json"
    d = json.loads(cfg_path.read_text())
    del d["num_attention_heads"]
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_model(llama_folder, device="cpu")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001])
def test_truncated_safetensors(llama_folder: Path, keep: float) -> None:
    f = llama_folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(llama_folder, device="cpu")


def test_missing_shard(tmp_path: Path) -> None:
    _save_llama(tmp_path, _shard="20KB")
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="shard"):
        load_model(tmp_path, device="cpu")


def test_tied_config_with_different_lm_head(tmp_path: Path) -> None:
    _save_llama(tmp_path, tie_word_embeddings=False)
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    d["tie_word_embeddings"] = True
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(tmp_path, device="cpu")


def test_no_weights_and_no_pickle(tmp_path: Path) -> None:
    _save_llama(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_model(tmp_path, device="cpu")


def test_bad_dtype_and_path(llama_folder: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama_folder, device="cpu", dtype="float8")
    with pytest.raises(FileNotFoundError):
        load_model(llama_folder / "nope", device="cpu")


def test_state_dict_shape_error_on_direct_build() -> None:
    from llmlib.checkpoints.build import build_model

    cfg = ModelConfig(
        name="t",
        vocab_size=50,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        max_seq_len=16,
    )
    sd = Transformer(cfg).state_dict()
    sd["layers.0.attn.wv.weight"] = torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wv\.weight' has shape \(8, 32\)"):
        build_model(cfg, sd, device="cpu")
