"""Every family llmlib reads from a Hugging Face folder loads from a GGUF file too, the same model.

For each family, a random model saved by transformers (tests/test_families.py's cases, at widths a
block type can hold: every row a multiple of 32) is converted the way llama.cpp's converter writes
that architecture (tests/gguf_convert.py). Read back, the file must give the folder's config field
by field, the folder's weights (the same numbers; Gemma's norm gains less the 1 the converter
added, to float32 rounding), through the eager and the lazy reader alike, and the folder's logits;
a Q8_0 file, logits close to float32's, dequantized and as the file's own codes alike
(``quantization="gguf"``). Windows are shorter than the prompt, so a window read wrong fails here.
Last, what llama.cpp's converter leaves out (Mistral's window) loads as llama.cpp would run it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_convert import convert

import llmlib
from llmlib.checkpoints.gguf import config_from_gguf, open_gguf, read_gguf
from llmlib.checkpoints.hf import read_hf_config, read_hf_folder
from llmlib.checkpoints.lazy import lazy_gguf
from llmlib.kernels.flags import forced

pytest.importorskip("transformers")
from test_families import _hf_model, _ids

S, F = "sliding_attention", "full_attention"
#: test_families' cases at block-aligned widths (d_model 64 or 96, FFN 96, heads of 16).
WIDTHS: dict[str, dict] = {
    "qwen2": dict(
        hidden_size=64, num_attention_heads=4, intermediate_size=96, use_sliding_window=False
    ),
    "qwen3": dict(hidden_size=64, head_dim=16, intermediate_size=96),  # 6 heads: q rows 96
    "qwen3_moe": dict(
        hidden_size=64,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        norm_topk_prob=True,  # what llama.cpp assumes: test_norm_topk_prob_false for the other
    ),
    "mistral": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96
    ),
    "phi3": dict(hidden_size=64, num_attention_heads=4, intermediate_size=96),
    "gemma2": dict(hidden_size=64, head_dim=16, intermediate_size=96, query_pre_attn_scalar=16),
    "gemma3_text": dict(  # llama.cpp's period of 6: five local layers, a global one, a local one
        hidden_size=96,  # transformers wants it a multiple of the 6 heads
        head_dim=16,
        intermediate_size=96,
        query_pre_attn_scalar=16,
        num_hidden_layers=7,
        layer_types=[S] * 5 + [F, S],
    ),
}
FAMILIES = sorted(WIDTHS)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path, Path, Path]]:
    """Per family: the transformers model, its folder, and that folder as F32 and Q8_0 GGUF."""
    out = {}
    for family in FAMILIES:
        hf = _hf_model(family, **WIDTHS[family])
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(folder)
        f32 = convert(folder, folder / "f32.gguf", T.F32)
        q8 = convert(folder, folder / "q8_0.gguf", T.Q8_0)
        out[family] = (hf, folder, f32, q8)
    return out


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).float()


@pytest.fixture(scope="module")
def folder_logits(files):
    """The folder's model's logits on the test prompts, per family, computed once."""
    cache: dict[str, torch.Tensor] = {}

    def get(family: str) -> torch.Tensor:
        if family not in cache:
            model = llmlib.load_model(files[family][1], device="cpu", dtype=torch.float32)
            cache[family] = _logits(model, _ids())
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_config_equals_the_folders(files, family: str) -> None:
    _, folder, f32, q8 = files[family]
    want = dataclasses.asdict(read_hf_config(folder))
    for path in (f32, q8):
        got = dataclasses.asdict(config_from_gguf(open_gguf(path)))
        assert {k: v for k, v in got.items() if k != "name"} == {
            k: v for k, v in want.items() if k != "name"
        }, path.name


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_equal_the_folders(files, family: str) -> None:
    _, folder, f32, _ = files[family]
    _, want = read_hf_folder(folder)
    _, got = read_gguf(f32, progress=False)
    _, lazy = lazy_gguf(f32)
    assert got.keys() == want.keys() == lazy.keys()
    for k, w in want.items():
        assert torch.equal(lazy[k].load(), got[k]), k
        if family.startswith("gemma") and k.endswith("norm.weight"):  # (1 + w) - 1 in float32
            torch.testing.assert_close(got[k], w, atol=2**-23, rtol=0, msg=k)
        else:
            assert torch.equal(got[k], w), k


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_logits_equal_the_folders(files, folder_logits, family: str) -> None:
    hf, _, f32, _ = files[family]
    ids, ref = _ids(), folder_logits(family)
    got = _logits(llmlib.load_model(f32, device="cpu", dtype=torch.float32), ids)
    assert ref.std() > 0.1
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    with torch.no_grad():
        assert (got - hf(ids).logits).abs().max() < 1e-4  # and so transformers' own


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_weights_are_the_folders_rounded(files, family: str) -> None:
    """Each matrix of the Q8_0 file reads back as exactly gguf's own Q8_0 rounding of the
    folder's (the blocks lie along rows, so the permuted, fused and stacked rows round alike);
    norms and the router stay float32."""
    _, folder, _, q8 = files[family]
    _, want = read_hf_folder(folder)
    _, got = read_gguf(q8, progress=False)
    assert got.keys() == want.keys()
    for k, w in want.items():
        if w.dim() == 2 and not k.endswith("router.weight"):
            q = gguf.quants.quantize(w.numpy(), T.Q8_0)
            w = torch.from_numpy(gguf.quants.dequantize(q, T.Q8_0))
            assert not torch.equal(w, want[k]), k
        if family.startswith("gemma") and k.endswith("norm.weight"):
            torch.testing.assert_close(got[k], w, atol=2**-23, rtol=0, msg=k)
        else:
            assert torch.equal(got[k], w), k


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_logits_follow_float32(files, folder_logits, family: str) -> None:
    """Close to float32 (these random models' logits move about 2% under Q8_0's rounding), and
    the same whether the blocks are dequantized or kept as codes (``quantization="gguf"``) and
    multiplied in float activations; the integer kernels, which round the activations to int8
    too, stay close."""
    q8, ids, ref = files[family][3], _ids(), folder_logits(family)
    dense = _logits(llmlib.load_model(q8, device="cpu", dtype=torch.float32), ids)
    err = ((dense - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.05, err
    with forced(integer="off"):  # PyTorch's kernels: 8-bit codes in groups become dense, exact
        codes = llmlib.load_model(q8, device="cpu", dtype=torch.float32, quantization="gguf")
    assert codes.weight_format.startswith("gguf"), codes.weight_format
    torch.testing.assert_close(_logits(codes, ids), dense, atol=1e-4 * dense.abs().max(), rtol=0)
    fast = _logits(
        llmlib.load_model(q8, device="cpu", dtype=torch.float32, quantization="gguf"), ids
    )
    fast_err = ((fast - dense).norm() / dense.norm()).item()
    assert fast_err < 0.05, fast_err


def test_what_llamacpp_leaves_out(files, tmp_path: Path) -> None:
    """llama.cpp's converter drops Mistral's window: such a file is a plain Llama model (what
    llama.cpp runs). It cannot name Qwen3-MoE's dense layers, and refuses them."""
    _, folder, _, _ = files["mistral"]
    plain = config_from_gguf(open_gguf(convert(folder, tmp_path / "m.gguf", extras=False)))
    want = read_hf_config(folder).replace(family="llama", sliding_window=None)
    assert plain.replace(name=want.name) == want
    with pytest.raises(ValueError, match=r"Can not map tensor 'model\.layers\.1\.mlp\.\w+_proj"):
        convert(files["qwen3_moe"][1], tmp_path / "q.gguf", extras=False)


def test_norm_topk_prob_false(tmp_path: Path) -> None:
    """Qwen3-MoE without renormalised router weights: expert_weights_norm says so."""
    hf = _hf_model("qwen3_moe", **{**WIDTHS["qwen3_moe"], "norm_topk_prob": False})
    hf.save_pretrained(tmp_path)
    path = convert(tmp_path, tmp_path / "m.gguf")
    cfg = config_from_gguf(open_gguf(path))
    assert not cfg.norm_topk_prob and cfg.dense_layers == (1,)
    assert cfg.replace(name="x") == read_hf_config(tmp_path).replace(name="x")
    ids = _ids(1)
    with torch.no_grad():
        want = hf(ids).logits
    got = _logits(llmlib.load_model(path, device="cpu", dtype=torch.float32), ids)
    assert (got - want).abs().max() < 1e-4


def test_what_does_not_add_up_fails_by_name(files, tmp_path: Path) -> None:
    """A fused tensor whose rows the metadata does not account for, a Gemma 3 file without its
    window (llama.cpp requires one too), an architecture llmlib does not read: each a ValueError
    naming the tensor, the key, the architecture."""
    import json
    import shutil

    from test_gguf import TINY, random_hf_weights, write_gguf

    def edited(family: str, **changes) -> Path:
        folder = tmp_path / family
        shutil.copytree(files[family][1], folder, ignore=shutil.ignore_patterns("*.gguf"))
        d = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**d, **changes}))
        return convert(folder, folder / "x.gguf")

    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has 192 rows, expected 160"):
        read_gguf(edited("phi3", intermediate_size=80), progress=False)
    with pytest.raises(ValueError, match=r"missing the required field 'gemma3\.attention\.sliding"):
        llmlib.load_model(edited("gemma3_text", sliding_window_pattern=1))
    path = write_gguf(tmp_path / "g.gguf", TINY, random_hf_weights(TINY), arch="gemma")
    with pytest.raises(ValueError, match=r"architecture is 'gemma'; llmlib reads only .*gemma3"):
        read_gguf(path, progress=False)
