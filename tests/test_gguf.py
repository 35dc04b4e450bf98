"""llmlib.gguf: config from metadata, tensor names and layout, and the bad-input errors.

Small synthetic files are written with gguf's own GGUFWriter; the real SmolLM2 file is checked
against the preset config and (``model`` marker) against transformers' reading of the same file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import kquant_blocks
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from llmlib.checkpoints.build import load_model
from llmlib.checkpoints.gguf import permute_qk, read_gguf, unpermute_qk
from llmlib.config import PRESETS, ModelConfig
from llmlib.shapes import param_shapes as expected_shapes

TINY = ModelConfig(
    name="tiny",
    vocab_size=64,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    max_seq_len=256,
    rope_theta=50_000.0,
    norm_eps=1e-6,
    tie_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)

GGUF_OF = {
    "embed": "token_embd",
    "norm": "output_norm",
    "lm_head": "output",
    "attn_norm": "attn_norm",
    "attn.wq": "attn_q",
    "attn.wk": "attn_k",
    "attn.wv": "attn_v",
    "attn.wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "ffn.w_gate": "ffn_gate",
    "ffn.w_up": "ffn_up",
    "ffn.w_down": "ffn_down",
}


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permutation of Q/K rows, written out independently."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def random_hf_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal(s) * 0.5).astype(np.float32)
        for k, s in expected_shapes(cfg).items()
    }


def gguf_name(key: str) -> str:
    stem = key.removesuffix(".weight")
    if stem in GGUF_OF:
        return GGUF_OF[stem] + ".weight"
    _, i, rest = stem.split(".", 2)
    return f"blk.{i}.{GGUF_OF[rest]}.weight"


def encode_tensor(arr: np.ndarray, t: T) -> np.ndarray:
    """``arr`` as GGUF type ``t``: gguf's own encoder, the tests' K-quant one
    (tests/kquant_blocks.py), or zero bytes for a type neither encodes (IQ4_NL, ...)."""
    if t.name in kquant_blocks.ENCODERS:
        return kquant_blocks.encode(arr, t.name)
    try:
        return gguf.quants.quantize(arr, t)
    except NotImplementedError:
        return np.zeros(gguf.quants.quant_shape_to_byte_shape(arr.shape, t), np.uint8)


def write_gguf(
    path: Path,
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    qtype: T = T.F32,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
    types: dict[str, T] | None = None,
    metadata_cfg: ModelConfig | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write HF-layout ``weights`` as llama.cpp would: GGUF names, Q/K permuted, quantized."""
    m = metadata_cfg or cfg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(m.n_layers)
    w.add_context_length(m.max_seq_len)
    w.add_embedding_length(m.d_model)
    w.add_feed_forward_length(m.ffn_dim)
    w.add_head_count(m.n_heads)
    w.add_head_count_kv(m.n_kv_heads)
    w.add_rope_freq_base(m.rope_theta)
    w.add_layer_norm_rms_eps(m.norm_eps)
    w.add_rope_dimension_count(m.head_dim)
    w.add_vocab_size(m.vocab_size)
    w.add_bos_token_id(m.bos_token_id)
    w.add_eos_token_id(m.eos_token_ids[0])
    for key, arr in weights.items():
        name = gguf_name(key)
        if name in skip:
            continue
        if key.endswith("attn.wq.weight"):
            arr = hf_to_gguf_permute(arr, m.n_heads)
        elif key.endswith("attn.wk.weight"):
            arr = hf_to_gguf_permute(arr, m.n_kv_heads)
        t = (types or {}).get(name, T.F32 if arr.ndim == 1 else qtype)
        q = encode_tensor(arr, t)
        w.add_tensor(name, q, raw_dtype=t if t not in (T.F32, T.F16) else None)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_permutations_are_inverse() -> None:
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert torch.equal(permute_qk(w, 4), torch.from_numpy(hf_to_gguf_permute(w.numpy(), 4)))
    assert not torch.equal(permute_qk(w, 4), w)


def test_f32_roundtrip_gives_hf_layout(tmp_path: Path) -> None:
    weights = random_hf_weights(TINY)
    path = write_gguf(tmp_path / "tiny.gguf", TINY, weights)
    cfg, sd = read_gguf(path, progress=False)
    assert dataclasses.replace(cfg, name="tiny") == TINY
    assert set(sd) == set(weights)
    for k, v in weights.items():
        assert sd[k].dtype == torch.float32
        assert torch.equal(sd[k], torch.from_numpy(v)), k  # exact: Q/K un-permuted, dims reversed


#: a config whose every matrix row is a multiple of 256 weights, as the K-quants need
WIDE = TINY.replace(d_model=256, ffn_dim=512, head_dim=64)
FILE_TYPES = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
FILE_TYPES += [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", FILE_TYPES, ids=lambda t: t.name)
def test_quantized_file_equals_gguf_dequantize(tmp_path: Path, qtype: T) -> None:
    cfg = (WIDE if qtype.name.endswith("_K") else TINY).replace(tie_embeddings=True)
    weights = random_hf_weights(cfg, seed=qtype.value)
    path = write_gguf(tmp_path / "q.gguf", cfg, weights, qtype=qtype)
    _, sd = read_gguf(path, progress=False)
    assert "lm_head.weight" not in sd
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed(t.shape.tolist()))
        )
        key = {gguf_name(k): k for k in weights}[t.name]
        ref = torch.from_numpy(np.array(ref, dtype=np.float32))
        if key.endswith("attn.wq.weight"):
            ref = unpermute_qk(ref, cfg.n_heads)
        elif key.endswith("attn.wk.weight"):
            ref = unpermute_qk(ref, cfg.n_kv_heads)
        assert torch.equal(sd[key], ref), key
        if t.tensor_type != T.F32:
            assert t.tensor_type == qtype


def test_config_keys_read(tmp_path: Path) -> None:
    cfg = TINY.replace(
        n_kv_heads=1, norm_eps=1e-5, rope_theta=500_000.0, max_seq_len=1024, eos_token_ids=(7,)
    )
    cfg_read, _ = read_gguf(
        write_gguf(tmp_path / "c.gguf", cfg, random_hf_weights(cfg)), progress=False
    )
    for f in (
        "n_kv_heads",
        "norm_eps",
        "rope_theta",
        "max_seq_len",
        "eos_token_ids",
        "bos_token_id",
        "head_dim",
    ):
        assert getattr(cfg_read, f) == getattr(cfg, f), f


# ---- bad input ------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", TINY, random_hf_weights(TINY), arch="gpt2")
    with pytest.raises(ValueError, match=r"general\.architecture.*'gpt2'"):
        read_gguf(path, progress=False)


def test_unknown_quantization_type(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "q.gguf", TINY, random_hf_weights(TINY), types={"blk.1.ffn_up.weight": T.IQ4_NL}
    )
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight: GGUF type IQ4_NL \(id 20\)"):
        read_gguf(path, progress=False)


def test_missing_tensor(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", TINY, random_hf_weights(TINY), skip=("blk.1.attn_v.weight",)
    )
    with pytest.raises(
        ValueError, match=r"missing tensor.*layers\.1\.attn\.wv\.weight.*blk\.1\.attn_v\.weight"
    ):
        load_model(path)


def test_extra_tensor(tmp_path: Path) -> None:
    # Weights for two layers, metadata for one: layer 1's tensors are not in the config.
    path = write_gguf(
        tmp_path / "e.gguf", TINY, random_hf_weights(TINY), metadata_cfg=TINY.replace(n_layers=1)
    )
    with pytest.raises(
        ValueError, match=r"unexpected tensor.*layers\.1\..*no place for it in this config"
    ):
        load_model(path)


def test_unknown_tensor_name(tmp_path: Path) -> None:
    extra = {"blk.0.attn_q.bias": np.zeros(TINY.d_model, np.float32)}
    path = write_gguf(tmp_path / "b.gguf", TINY, random_hf_weights(TINY), extra=extra)
    with pytest.raises(ValueError, match=r"unexpected tensor.*blk\.0\.attn_q\.bias"):
        read_gguf(path, progress=False)


def test_shape_mismatch_vs_config(tmp_path: Path) -> None:
    weights = random_hf_weights(TINY)
    path = write_gguf(tmp_path / "s.gguf", TINY, weights, metadata_cfg=TINY.replace(ffn_dim=128))
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.ffn\.w_\w+\.weight \(GGUF blk\.0\.ffn_\w+\.weight\)' has shape "
        r"\(\d+, \d+\) but the config implies",
    ):
        load_model(path)


@pytest.mark.parametrize("keep", [0.0005, 0.3, 0.999])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    path = write_gguf(tmp_path / "t.gguf", TINY, random_hf_weights(TINY), qtype=T.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        read_gguf(cut, progress=False)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "nope.gguf")


# ---- the real model -------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_config_matches_preset(smollm2_path: Path) -> None:
    cfg, sd = read_gguf(smollm2_path, progress=False)
    preset = PRESETS["smollm2-135m"]
    for f in dataclasses.fields(ModelConfig):
        if f.name != "name":
            assert getattr(cfg, f.name) == getattr(preset, f.name), f.name
    assert set(sd) == set(expected_shapes(preset))
    assert all(v.dtype == torch.float32 for v in sd.values())


@pytest.mark.model
def test_smollm2_logits_match_transformers(smollm2_path: Path, hf_smollm2) -> None:
    import llmlib

    # "The capital of France is Paris. The capital of Germany is" in SmolLM2's vocabulary.
    ids = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits
        model = llmlib.load_model(smollm2_path, device="cpu", dtype=torch.float32)
        ours = model(torch.tensor([ids]))
    assert ours.shape == ref.shape == (1, len(ids), 49_152)
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours[0, -1].argmax(), ref[0, -1].argmax())
