"""Weight-only int8/int4: each kernel against a float reference, the GGUF repacking against the
file's own values, bad combinations refused by name, and a whole tiny model in every format."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf import TINY, WIDE, random_hf_weights, write_gguf

import llmlib
from llmlib.checkpoints.quant import dequantize
from llmlib.checkpoints.repack import block_codes, model_codes, repack_error
from llmlib.config import ModelConfig
from llmlib.generate import Generator
from llmlib.kernels import integer as vnni
from llmlib.kernels import onednn
from llmlib.kernels.flags import forced
from llmlib.kernels.prepare import prepare, quantize_model, weight_matrices
from llmlib.kernels.stacked import StackedWeight
from llmlib.kernels.weights import Int4Weight, PackedWeight
from llmlib.kernels.weights import pack_reference as pack
from llmlib.model import random_model
from llmlib.quantize import GroupCodes, quantize_int4, quantize_int8
from llmlib.shapes import kv_cache_bytes

CPU = torch.device("cpu")

ROOT = Path(__file__).resolve().parents[1]


_needs_onednn_bf16 = pytest.mark.skipif(
    not onednn.supported(),
    reason="oneDNN has no bfloat16 path on this CPU (AVX2 only)",
)


def _x(k: int, m: int = 3, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_kernel_equals_float_product_of_its_codes(dtype) -> None:
    w = torch.randn(128, 96, generator=torch.Generator().manual_seed(0))
    codes = quantize_int8(w)
    assert (codes.dequantize() - w).abs().max() <= codes.scale.max() / 2 + 1e-6  # round to nearest
    packed = pack(codes, dtype, "cpu")
    x = _x(96, dtype=dtype)
    ref = x.float() @ (codes.q.float() * codes.scale.to(dtype).float()[:, None]).T
    got = packed.linear(x).float()
    assert got.dtype == torch.float32 and got.shape == (3, 128)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    ids = torch.tensor([[0, 5, 127]])
    assert torch.equal(
        packed.rows(ids), (codes.q[ids].to(dtype) * codes.scale.to(dtype)[ids, None])
    )


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_kernel_equals_float_product_of_its_codes(group, dtype) -> None:
    w = torch.randn(192, 128, generator=torch.Generator().manual_seed(0)) + 0.3
    codes = quantize_int4(w, group)
    steps = codes.scale.repeat_interleave(group, dim=1)
    assert ((codes.dequantize() - w).abs() <= steps / 2 + 1e-5).all()  # within half a step
    packed = pack(codes, dtype, "cpu")
    assert isinstance(packed, Int4Weight)
    x = _x(128, dtype=dtype)
    rounded = GroupCodes(
        codes.q, codes.scale.to(dtype).float(), codes.zero.to(dtype).float(), group
    )
    ref = x.float() @ rounded.dequantize().T
    got = packed.linear(x).float()
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    # the row lookup reads the kernel's own packed layout back (or the kept codes)
    ids = torch.tensor([0, 1, 63, 64, 100, 191])
    assert torch.allclose(packed.rows(ids).float(), rounded.dequantize()[ids], rtol=1e-2, atol=1e-2)
    packed.keep_codes_for_rows(codes)
    assert torch.allclose(packed.rows(ids).float(), rounded.dequantize()[ids], rtol=1e-2, atol=1e-2)


def test_bad_combinations_name_the_tensor_and_the_choice() -> None:
    with pytest.raises(ValueError, match=r"w_down.*group size 128 does not divide its 96"):
        quantize_int4(torch.randn(8, 96), 128, name="layers.0.ffn.w_down.weight")
    with pytest.raises(ValueError, match="group size 48 is not one of"):
        quantize_int4(torch.randn(8, 96), 48)
    with pytest.raises(ValueError, match="kernels exist for cpu and cuda, not meta"):
        pack(quantize_int8(torch.randn(8, 32)), torch.bfloat16, "meta")
    model = random_model(TINY.replace(ffn_dim=80), device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ffn.w_down.weight: int4 group size 32 does not divide"):
        quantize_model(model, "int4", group_size=32)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "int3")


def _gguf(tmp_path: Path, qtype: T, tie: bool = False) -> tuple[Path, ModelConfig]:
    cfg = TINY.replace(tie_embeddings=tie)
    weights = random_hf_weights(cfg, seed=3)
    if tie:
        weights.pop("lm_head.weight", None)
    return write_gguf(tmp_path / f"m_{qtype.name}.gguf", cfg, weights, qtype), cfg


BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_blocks_repack_exactly(tmp_path: Path, qtype: T) -> None:
    """A file's blocks, read by the loader (q/k rows un-permuted), give codes whose values are the
    file's: bit for bit for the 6- and 8-bit codes and Q4_0; for Q4_1/Q4_K (4-bit codes with a
    minimum) up to the float32 rounding of the zero point ``8 s - m`` (see test_quant). Only the
    constants' dtype rounds more."""
    cfg = WIDE if qtype.name.endswith("_K") else TINY
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg, seed=3), qtype)
    blocks: dict = {}
    _, state, _ = llmlib.checkpoints.read_checkpoint(path, blocks=blocks)
    assert blocks and all(kind == qtype.name for kind, _ in blocks.values())
    for name, (kind, raw) in blocks.items():
        c = block_codes(kind, raw, name)
        four = qtype in (T.Q4_0, T.Q4_1, T.Q4_K)
        assert c.bits == (4 if four else 8 if qtype == T.Q8_0 else 6)
        if qtype in (T.Q4_1, T.Q4_K):
            assert torch.allclose(c.dequantize(), state[name], rtol=0, atol=1e-6), name
        else:
            assert torch.equal(c.dequantize(), state[name]), name
    err = repack_error(blocks, torch.bfloat16)[qtype.name]
    assert err["codes"] < 1e-6 and 0 < err["in_dtype"] < 2**-7
    if qtype not in (T.Q4_1, T.Q4_K):
        assert repack_error(blocks, torch.float32)[qtype.name]["codes"] == 0


#: what llama.cpp's Q4_K_M keeps in 6 bits: attn_v and ffn_down (and the output matrix)
Q4_K_M = {
    **{f"blk.{i}.{n}.weight": T.Q6_K for i in range(2) for n in ("attn_v", "ffn_down")},
    "output.weight": T.Q6_K,
}


def test_gguf_q4_k_m_file_fuses_exactly_and_loads(tmp_path: Path) -> None:
    """q/k in Q4_K with v in Q6_K stay apart (each in its own kernel's layout), or fuse into one
    exact 6-bit matrix in groups of 16; gate/up (both Q4_K) stay 4-bit codes for the int4
    kernels. Under PyTorch's kernels (integer products off) the 6-bit ones stay dense, with the
    file's values: the model computes what the float32 reading of the file computes."""
    path = write_gguf(
        tmp_path / "m.gguf", WIDE, random_hf_weights(WIDE, seed=5), T.Q4_K, types=Q4_K_M
    )
    blocks: dict = {}
    _, state, _ = llmlib.checkpoints.read_checkpoint(path, blocks=blocks)
    ref = llmlib.load_model(path, "cpu", torch.float32)
    codes = model_codes(list(weight_matrices(ref)), blocks)
    for name in [n for n in codes if n.endswith("wqkv")]:  # q/k Q4_K, v Q6_K: kept apart
        qkv = codes[name]
        assert [(c.bits, c.group_size) for c in qkv.parts] == [(4, 32), (4, 32), (6, 16)]
        assert torch.equal(qkv.dequantize(), qkv.fused().dequantize())
        codes[name] = qkv.fused()
    kinds = {name: (c.bits, c.group_size) for name, c in codes.items()}
    assert kinds["layers.0.attn.wqkv"] == (6, 16) and kinds["layers.1.ffn.w_down"] == (6, 16)
    assert kinds["layers.0.ffn.w_gate_up"] == (4, 32) and kinds["layers.0.attn.wo"] == (4, 32)
    assert kinds["lm_head"] == (6, 16) and "embed" not in kinds  # untied: a table, not a product
    for name, c in codes.items():
        w = ref.get_submodule(name).weight.dequantize()
        assert torch.allclose(c.dequantize(), w, rtol=0, atol=1e-6), name
    with forced(integer="off"):  # PyTorch's weight-only kernels: float activations, exact
        model = llmlib.load_model(path, "cpu", torch.float32, "gguf")
    packed = {n for n, m in weight_matrices(model).items() if isinstance(m.weight, Int4Weight)}
    assert packed == {n for n, k in kinds.items() if k[0] == 4}
    ids = torch.randint(0, WIDE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(ids), rtol=1e-4, atol=1e-4)
    if vnni.available():  # the integer kernels: q/k in int4 tiles, v in 6-bit ones, side by side
        model = llmlib.load_model(path, "cpu", torch.float32, "gguf")
        w = model.get_submodule("layers.0.attn.wqkv").weight
        b = "vnni" if vnni.isa() == "avx512vnni" else "avx2"
        assert isinstance(w, StackedWeight)
        assert [type(p) for p in w.parts] == [vnni.VnniInt4Weight] * 2 + [vnni.VnniInt6Weight]
        want = ref.get_submodule("layers.0.attn.wqkv").weight.dequantize()
        n_v = w.parts[2].shape[0]  # v: exact (int8 steps, float32 units); q/k: float16 d and m
        assert torch.equal(w.parts[2].dequantize(), want[-n_v:])
        assert torch.allclose(w.dequantize(), want, rtol=0, atol=2e-3 * want.abs().max().item())
        x = torch.randn(3, WIDE.d_model, generator=torch.Generator().manual_seed(1))
        assert torch.equal(w.linear(x), torch.cat([p.linear(x) for p in w.parts], dim=-1))
        assert f"int4 g32 {b} + int6 g16 {b} x2" in model.weight_format


def test_gguf_q8_0_table_packs_for_the_8_bit_group_kernel(tmp_path: Path) -> None:
    """SmolLM2's file: Q4_1 matrices and a Q8_0 tied embedding table. Its codes are exact 8-bit
    codes (no per-row re-quantization). PyTorch has no kernel for 8-bit codes in groups, so the
    table is stored for llmlib's (``int8g_linear``) where the integer kernels run, and stays a
    dense matrix holding the file's values where they do not."""
    cfg = TINY.replace(tie_embeddings=True)
    weights = random_hf_weights(cfg, seed=3)
    weights.pop("lm_head.weight", None)
    path = write_gguf(
        tmp_path / "m.gguf", cfg, weights, T.Q4_1, types={"token_embd.weight": T.Q8_0}
    )
    blocks: dict = {}
    _, state, _ = llmlib.checkpoints.read_checkpoint(path, blocks=blocks)
    table = block_codes(*blocks["embed.weight"])
    assert (table.bits, table.group_size) == (8, 32)
    assert torch.equal(table.dequantize(), state["embed.weight"])
    with pytest.raises(ValueError, match="PyTorch has no kernel for 8-bit codes in groups"):
        pack(table, torch.float32, "cpu")
    with forced(integer="off"):
        dense = llmlib.load_model(path, "cpu", torch.float32, "gguf")
    assert not isinstance(dense.embed.weight, PackedWeight)
    assert torch.equal(dense.embed.weight, state["embed.weight"])
    model = llmlib.load_model(path, "cpu", torch.float32, "gguf")
    if vnni.available():
        assert isinstance(model.embed.weight, vnni.VnniInt8GroupWeight)
        assert torch.equal(model.embed.weight.dequantize(), state["embed.weight"])
    assert isinstance(model.layers[0].ffn.w_gate_up.weight, PackedWeight)


@pytest.mark.parametrize("quantization", ["int8", "int4", "gguf"])
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_model_in_every_format_follows_float32(tmp_path: Path, quantization, tie) -> None:
    path, cfg = _gguf(tmp_path, T.Q4_1 if quantization == "gguf" else T.F32, tie)
    # the reference holds in float32 exactly the values the codes stand for (for gguf: the file's)
    cfg_read, state, _ = llmlib.checkpoints.read_checkpoint(path)
    quant = {"int8": quantize_int8, "int4": quantize_int4}.get(quantization)
    if quant is not None:
        fused = {"wq", "wk", "wv", "w_gate", "w_up", "wo", "w_down"}
        for name in list(state):
            head = name in ("embed.weight", "lm_head.weight")
            if (head and (tie or name == "lm_head.weight")) or name.split(".")[-2] in fused:
                q = quantize_int8 if head else quant  # int4 keeps the LM head in int8
                state[name] = q(state[name]).dequantize()
    ref = llmlib.checkpoints.build_model(cfg_read, state, "cpu", torch.float32)
    model = llmlib.load_model(path, "cpu", torch.bfloat16, quantization)
    with forced(integer="off"):  # PyTorch's weight-only kernels: float activations, exact
        exact = llmlib.load_model(path, "cpu", torch.float32, quantization)
    fast = llmlib.load_model(path, "cpu", torch.float32, quantization)  # activations rounded
    # the weights are held once, packed: no dense matrix is left (but an untied embedding table,
    # of which a step reads one row), and the dtype is the activations'
    # (a GGUF file's untied table too, read row by row from its codes)
    dense = [n for n, p in model.named_parameters() if p.dim() == 2]
    table = tie or quantization == "gguf"
    assert dense == ([] if table else ["embed.weight"])
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    # 4 per layer and the LM head (tied or not), and a file's own untied table
    assert len(packed) == 4 * cfg.n_layers + 1 + (not tie and quantization == "gguf")
    assert model.dtype == torch.bfloat16 and quantization in model.weight_format
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = ref(ids), model(ids).float(), exact(ids)
    assert b.shape == a.shape
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05, float(rel)  # bfloat16 activations and constants
    assert torch.allclose(c, a, rtol=1e-4, atol=1e-4)  # float32: the same numbers as the codes
    with torch.no_grad():
        d = fast(ids)
    assert (d - a).norm() / a.norm() < 0.05  # the integer kernels' int8 activations
    # the embedding lookup from a tied packed table is the packed table's rows
    if tie:
        assert isinstance(model.embed.weight, PackedWeight)


def test_generator_kv_cache_in_the_models_dtype() -> None:
    """Chapter 8's formula follows the dtype: bfloat16 halves the cache, and the allocation is
    the formula."""
    tok = llmlib.train_bpe("the cat sat on the mat. " * 20, vocab_size=300, pattern="gpt4")
    cfg = TINY.replace(vocab_size=tok.vocab_size)
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = quantize_model(random_model(cfg, "cpu", dtype), "int8")
        gen = Generator(model, tok)
        out = gen.generate("the cat", max_new_tokens=4, ignore_eos=True)
        assert len(out.token_ids) == 4
        c = gen._cache
        assert c.k.dtype == dtype
        assert c.nbytes == kv_cache_bytes(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, c.max_len, dtype.itemsize
        )
        sizes[dtype] = c.nbytes
    assert sizes[torch.bfloat16] * 2 == sizes[torch.float32]


def test_gguf_needs_a_gguf_file_and_blocks(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(ValueError, match="repacks a .gguf file's blocks"):
        llmlib.load_model(folder, "cpu", quantization="gguf")
    path, _ = _gguf(tmp_path, T.F32)
    with pytest.raises(ValueError, match="stores no block-quantized matrix"):
        llmlib.load_model(path, "cpu", quantization="gguf")


def _fastest_within_one_percent(formats: list[dict], key: str) -> tuple[str, str | None]:
    # int4 is not a candidate: it rounds weights that a GGUF file already stores in 4-bit blocks
    # a second time, where "gguf" reads those blocks as they are
    ok = [
        f
        for f in formats
        if f.get("perplexity_vs_float32") is not None
        and f["perplexity_vs_float32"] <= 1.01
        and f["name"] not in ("float32", "int4")
    ]
    best = max(ok, key=lambda f: f[key])
    return best["dtype"], best["quantization"]


@pytest.mark.parametrize(
    "workload, record, key",
    [
        ("decode", "formats.json", "tokens_per_s"),
        ("batched", "batching_formats.json", "continuous_tokens_per_s"),
        ("decode_float32", "cpu/formats_as_avx2.json", "tokens_per_s"),
    ],
)
def test_auto_format_order_follows_the_recorded_measurements(workload, record, key) -> None:
    """``AUTO_CPU_FORMATS`` puts first the recorded fastest format within 1% of float32's
    perplexity, for one request (decode) and for the batching engine, and for one request on a
    CPU without native bfloat16 (run as an AVX2-only EPYC)."""
    from llmlib.device import AUTO_CPU_FORMATS

    rec = ROOT / "results" / record
    if not rec.exists():
        pytest.skip(f"no recorded {record}")
    formats = json.loads(rec.read_text())["formats"]
    assert _fastest_within_one_percent(formats, key) == AUTO_CPU_FORMATS[workload][0]


def test_one_request_without_native_bfloat16_reads_integer_codes() -> None:
    """On a CPU without native bfloat16 (an AVX2-only EPYC), one request runs the file's blocks,
    or int8 for a file without them, with float32 activations, where the integer kernels run;
    float32 where they are off; batches and asked-for formats stay as they were."""
    from llmlib import device
    from llmlib.kernels.flags import CLASSES

    f32 = torch.float32
    avx2 = dict(cpu_flags=CLASSES["avx2"].cpu_flags, isa="avx2", integer="avx2", fused_norm=False)
    with forced(**avx2):
        assert not device.native_bf16()
        choose = device.choose_format
        assert choose("cpu", None, None, gguf_blocks=True) == (device.Placement(CPU, f32), "gguf")
        assert choose("cpu", None, None) == (device.Placement(CPU, f32), "int8")
        assert choose("cpu", None, None, gguf_blocks=True, batched=True)[1] is None
        assert choose("cpu", "float32", None, gguf_blocks=True)[1] is None  # what was asked
    with forced(**avx2 | dict(integer="off")):  # LLMLIB_INTEGER=0
        assert choose("cpu", None, None, gguf_blocks=True) == (device.Placement(CPU, f32), None)


def test_dequantize_helpers_agree() -> None:
    """repack's Q4_1 reading equals the chapter-3 dequantizer on random blocks."""
    rng = np.random.default_rng(0)
    import gguf

    arr = rng.standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(arr, T.Q4_1)
    ref = dequantize(raw, T.Q4_1, (4, 64))
    got = block_codes("Q4_1", torch.from_numpy(np.ascontiguousarray(raw)).view(4, -1)).dequantize()
    assert torch.allclose(got, ref, atol=1e-6)


@_needs_onednn_bf16
def test_bfloat16_held_once_in_onednn_layout_equals_the_dense_product() -> None:
    from llmlib.kernels.onednn import OneDNNWeight

    cfg = TINY.replace(tie_embeddings=True)
    model = random_model(cfg, "cpu", torch.bfloat16)
    ref = random_model(cfg, "cpu", torch.bfloat16)
    prepare(model)
    kinds = {type(m.weight).__name__ for m in weight_matrices(model).values()}
    assert kinds == {"OneDNNWeight", "Parameter"}  # the tied table stays a plain matrix (rows)
    w = model.layers[0].ffn.w_gate_up.weight
    assert isinstance(w, OneDNNWeight) and w.dtype == torch.bfloat16
    dense = ref.layers[0].ffn.w_gate_up.weight
    assert torch.equal(w.dequantize(), dense)
    x = _x(cfg.d_model, dtype=torch.bfloat16)
    ref_y = x.float() @ dense.float().T
    assert (w.linear(x).float() - ref_y).abs().max() <= 1e-2 * ref_y.abs().max()
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).float(), model(ids).float()
    assert (a - b).norm() / a.norm() < 0.02


@pytest.mark.parametrize("k", [40, 47, 72])
@pytest.mark.parametrize("m", [1, 5])
def test_int8_bfloat16_on_widths_the_kernel_mishandles(k: int, m: int) -> None:
    """PyTorch's int8 kernel with bfloat16 inputs misreads rows whose width is not a multiple of
    16 (wrong numbers, or a crash); the padded weight gives the float product on every width."""
    w = torch.randn(30, k, generator=torch.Generator().manual_seed(3))
    codes = quantize_int8(w)
    packed = pack(codes, torch.bfloat16, "cpu")
    x = _x(k, m, torch.bfloat16)
    ref = x.float() @ codes.dequantize().T
    got = packed.linear(x).float()
    assert got.shape == (m, 30)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    rows = packed.rows(torch.tensor([0, 29]))
    assert rows.shape == (2, k)
    assert torch.allclose(rows.float(), codes.dequantize()[[0, 29]], rtol=1e-2, atol=1e-2)


@_needs_onednn_bf16
def test_compiled_onednn_bfloat16_gives_the_eager_tokens() -> None:
    """oneDNN's opaque bfloat16 layout never reaches a graph: the graph's view of the model
    (:func:`llmlib.runtime.compile.graph_view`) holds the same numbers as plain matrices and
    plain norms, sharing every other tensor, and leaves the model as it was. Compiled over the
    view with inductor's defaults: one graph (no breaks), the eager logits; and the bench
    accepts ``bfloat16+compile``."""
    from torch._dynamo.utils import counters

    from llmlib.bench.formats import parse_formats
    from llmlib.kernels.norm import FusedRMSNorm
    from llmlib.kernels.onednn import OneDNNWeight
    from llmlib.model.kv_cache import KVCache
    from llmlib.runtime.compile import graph_view

    cfg = TINY.replace(vocab_size=300)
    model = random_model(cfg, "cpu", torch.bfloat16)
    prepare(model)
    assert isinstance(model.layers[0].ffn.w_gate_up.weight, OneDNNWeight)
    view = graph_view(model)
    dense = {n: m.weight for n, m in weight_matrices(model).items()}
    for name, mod in weight_matrices(view).items():
        w = mod.weight
        if isinstance(dense[name], OneDNNWeight):  # the plain layer back, for freezing to fold
            assert isinstance(w, torch.nn.Parameter) and torch.equal(w, dense[name].dequantize())
        else:  # the same tensors: nothing else is copied
            assert w is dense[name] or w.data_ptr() == dense[name].data_ptr()
    assert not any(isinstance(m, FusedRMSNorm) for m in view.modules())
    assert isinstance(model.layers[0].ffn.w_gate_up.weight, OneDNNWeight)  # the model as it was

    def decode_step(model, ids, positions, cache):
        return model(ids, positions, cache, last_only=True)

    def step(m, fn):
        cache = KVCache(cfg.n_layers, 1, cfg.n_kv_heads, 16, cfg.head_dim, dtype=torch.bfloat16)
        with torch.inference_mode():
            m(torch.tensor([[5, 7, 9]]), torch.arange(3)[None], cache)
            return fn(m, torch.tensor([[11]]), torch.tensor([[3]]), cache)

    eager = step(model, decode_step)
    torch._dynamo.reset()
    counters.clear()
    compiled = step(view, torch.compile(decode_step))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.allclose(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)
    assert parse_formats("float32,bfloat16+compile") == [("float32", False), ("bfloat16", True)]


def test_engine_compiles_cpu_int8_frozen() -> None:
    """On the CPU a quantized (or bfloat16) model's fixed-shape step is compiled frozen and
    autotuned (:mod:`llmlib.runtime.compile`): one graph, the eager tokens; float32 keeps
    inductor's defaults. (bfloat16 takes the same path; compiling it too would double this
    test's time.) A model built in memory compiles in memory; tests/test_aot.py the packages."""
    from functools import partial

    from torch._dynamo.utils import counters

    from llmlib.engine import LLM
    from llmlib.engine.fixed_step import engine_forward
    from llmlib.runtime.compile import compile_options

    tok = llmlib.train_bpe("the cat sat on the mat. " * 20, vocab_size=300, pattern="gpt4")
    model = random_model(TINY.replace(vocab_size=tok.vocab_size), "cpu", torch.bfloat16, seed=1)
    with torch.no_grad():  # peaked logits: fused bfloat16 arithmetic must not flip a near tie
        model.lm_head_weight.mul_(8.0)
    quantize_model(model, "int8")
    prepare(model)
    assert compile_options(model)["freezing"] is True
    assert compile_options(random_model(TINY, "cpu")) is None
    params = llmlib.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=16, block_size=16, max_num_seqs=2)
    prompt = tok.encode("the cat")
    eager = LLM(model, tok, **kw).generate([prompt], params, use_tqdm=False)[0]
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(model, tok, compile=True, **kw)
    assert llm.runner.decode_path == "compiled (in memory)" and llm.compile_s > 0
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    # one graph: a break (say, an untraceable call inside linear()) leaves each piece between
    # breaks compiled on its own, and the step slower than eager
    assert not counters["graph_break"], dict(counters["graph_break"])
    if vnni.available():  # the loader stored the int8 matrices for the integer kernels
        assert any(
            isinstance(m.weight, vnni.VnniInt8Weight) for m in weight_matrices(model).values()
        )
    # the compiled step's logits are the eager step's, to bfloat16's rounding (the compiled graph
    # fuses the small operators in float32), along the compiled run's own tokens: so greedy
    # choices agree wherever the two best tokens are further apart than that rounding
    compiled = _teacher_forced(model, llm.runner.graphs.forward, prompt, out.token_ids)
    want = _teacher_forced(model, partial(engine_forward, model), prompt, out.token_ids)
    for e, c in zip(want, compiled):
        assert (e - c).abs().max() < 0.02 * e.abs().max() + 0.04
        top = e.topk(2).values
        if top[0] - top[1] > 0.1:
            assert c.argmax() == e.argmax()
    agree = sum(a == b for a, b in zip(eager.token_ids, out.token_ids))
    assert agree >= len(out.token_ids) - 1, (eager.token_ids, out.token_ids)


def _teacher_forced(model, forward, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits of each decode step of the engine's fixed-shape step run by ``forward`` (two
    rows, the second padding), fed ``tokens`` (not its own) after an eager prefill."""
    from llmlib.engine.fixed_step import FixedStep
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk

    cfg = model.config
    cache = PagedKVCache(cfg.n_layers, 9, cfg.n_kv_heads, 16, cfg.head_dim, dtype=model.dtype)
    table = list(range(8))  # block 8: the scratch block
    with torch.inference_mode():
        step = cache.step([[SeqChunk(table, 0, len(prompt))]])
        h = model.hidden(torch.tensor([prompt]), step.positions, step)
        out = [model.logits(h[0, -1:])[0].float()]
        for i, t in enumerate(tokens[:-1]):
            fs = FixedStep(cache, 2, 4, 8)
            fs.fill([SeqChunk(table, len(prompt) + i, 1)], [t])
            out.append(forward(fs.ids, fs.positions, fs)[0].float())
    return out


def test_two_compiled_generators_keep_their_own_graphs() -> None:
    """A compiled step skips dynamo's guards on modules (llmlib.runtime.compile.own_step): a second
    model of the same shape, compiled in the same process, still runs its own frozen weights,
    not the first's graph, nor the first's codes out of inductor's cache (this tiny model's
    widths leave some int8 matrices to inductor's kernels: codes_left_to_inductor)."""
    from llmlib.model.kv_cache import KVCache
    from llmlib.runtime.compile import codes_left_to_inductor, compile_step, graph_view

    def decode_step(model, ids, positions, cache):
        return model(ids, positions, cache, last_only=True)

    cfg = TINY.replace(vocab_size=300)
    models = []
    for seed in (1, 2):
        m = random_model(cfg, "cpu", torch.bfloat16, seed=seed)
        quantize_model(m, "int8")
        prepare(m)
        models.append(m)

    def step(model, fn):
        cache = KVCache(cfg.n_layers, 1, cfg.n_kv_heads, 16, cfg.head_dim, dtype=torch.bfloat16)
        with torch.inference_mode():
            model(torch.tensor([[5, 7, 9]]), torch.arange(3)[None], cache)
            return fn(model, torch.tensor([[11]]), torch.tensor([[3]]), cache).float()

    torch._dynamo.reset()
    filters = []
    compile_ = torch.compile

    def spy(fn, **kw):  # what compile_step asks torch.compile for
        filters.append(kw.get("options", {}).get("guard_filter_fn"))
        return compile_(fn, **kw)

    steps = []
    views = [graph_view(m) for m in models]  # what a graph runs: llmlib.runtime.compile
    with mock.patch.object(torch, "compile", spy):
        for v in views:
            steps.append(compile_step(decode_step, v))
    assert filters == [torch.compiler.skip_guard_on_all_nn_modules_unsafe] * 2
    assert codes_left_to_inductor(models[0]) > 0
    got = [step(v, s) for v, s in zip(views, steps)]
    want = [step(m, decode_step) for m in models]  # eager, on the model's own layouts
    assert not torch.allclose(want[0], want[1], atol=1e-2)  # the two models differ
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=2e-2, rtol=2e-2)


def test_engine_kv_pool_in_the_models_dtype() -> None:
    """The batching engine's pool follows the activations' dtype, and its allocation is chapter
    8's formula per block."""
    from llmlib.engine import LLM

    tok = llmlib.train_bpe("the cat sat on the mat. " * 20, vocab_size=300, pattern="gpt4")
    cfg = TINY.replace(vocab_size=tok.vocab_size)
    model = random_model(cfg, "cpu", torch.bfloat16)
    llm = LLM(model, tok, num_blocks=16, block_size=4, quantization="int8")
    assert llm.dtype == torch.bfloat16 and llm.runner.cache.k[0].dtype == torch.bfloat16
    per_block = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, 2)
    assert llm.kv_cache_bytes == 16 * per_block
    outs = llm.generate(
        ["the cat", "the mat"],
        llmlib.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in outs] == [4, 4]
