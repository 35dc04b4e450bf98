"""llmlib.quant against the reference dequantizer in the `gguf` package, bit for bit, and the
codes repack makes from the same bytes against both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from kquant_blocks import encode_with_values

from llmlib.checkpoints.quant import FORMATS, block_format, dequantize
from llmlib.checkpoints.repack import block_codes, fuse, model_codes, repack_error
from llmlib.gguf_file import GGML_TYPES
from llmlib.quantize import CodeParts, GroupCodes

FLOATS = [T.F32, T.F16, T.BF16]
LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # 32-weight blocks; gguf can encode them
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]  # 256-weight super-blocks; gguf only decodes
BLOCK_TYPES = LEGACY + K_QUANTS
SUPPORTED = FLOATS + BLOCK_TYPES
#: byte offsets of each block type's float16 constants (d, and m or dmin)
F16_AT = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
#: (code bits, group size) that repack gives each block type
KINDS = {T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q4_K: (4, 32), T.Q8_0: (8, 32), T.Q5_0: (6, 32)}
KINDS |= {T.Q5_1: (6, 32), T.Q5_K: (6, 32), T.Q6_K: (6, 16), T.Q3_K: (6, 16), T.Q2_K: (6, 16)}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _random_blocks(qtype: T, rows: int, cols: int, seed: int, spread: float = 1.0) -> np.ndarray:
    """``[rows, bytes]`` of random bytes, with finite float16 constants (magnitudes from 2**-14
    to 2**2 times ``spread``, either sign) so that every value is a number."""
    f = block_format(qtype.value)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // f.block_size * f.block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, f.block_bytes)
    for i, at in enumerate(F16_AT[qtype]):
        mag = 2.0 ** rng.uniform(-14, 2, size=len(blocks)) * (spread if i else 1.0)
        c = (mag * rng.choice([-1.0, 1.0], size=len(blocks))).astype(np.float16)
        blocks[:, at : at + 2] = c.view(np.uint8).reshape(-1, 2)
    return raw


def test_formats_match_gguf_sizes() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert {T(f.type_id) for f in FORMATS.values()} == set(SUPPORTED)
    for f in FORMATS.values():
        assert GGML_QUANT_SIZES[T(f.type_id)] == (f.block_size, f.block_bytes), f.name
        assert T(f.type_id).name == f.name
        # the container reads exactly the types the decoder decodes, with the same sizes
        assert GGML_TYPES[f.type_id] == (f.name, f.block_size, f.block_bytes)
    assert set(GGML_TYPES) == set(FORMATS)
    assert block_format(T.Q4_1).bits_per_weight == 5.0
    assert block_format(T.Q4_K).bits_per_weight == 4.5
    assert block_format("Q6_K").bits_per_weight == 6.5625


@pytest.mark.parametrize("qtype", FLOATS + LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 96)])
def test_dequantize_quantized_random_data(qtype: T, shape: tuple[int, ...]) -> None:
    """Quantize random data with gguf, then both dequantizers must give identical float32 bits."""
    rng = np.random.default_rng(sum(shape) + qtype.value)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    x.flat[0] = 0.0  # exercise a zero and an all-equal block too
    if x.ndim > 1:
        x[0, ...] = 1.5
    q = quants.quantize(x, qtype)
    ref = quants.dequantize(q, qtype)
    ours = dequantize(q, qtype.value, shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert _same_bits(ours.numpy(), ref)


@pytest.mark.parametrize("qtype", LEGACY + [T.BF16, T.F16], ids=lambda t: t.name)
def test_dequantize_arbitrary_random_blocks(qtype: T) -> None:
    """Random bytes (any scale, any nibble, NaN/inf patterns included) decode exactly as gguf does."""
    f = block_format(qtype.value)
    rng = np.random.default_rng(qtype.value)
    rows, cols = 7, 4 * 32
    raw = rng.integers(0, 256, size=(rows, cols // f.block_size * f.block_bytes), dtype=np.uint8)
    with np.errstate(invalid="ignore"):  # inf * 0 in a block whose random scale is inf
        ref = quants.dequantize(raw, qtype) if qtype != T.F16 else raw.view(np.float16)
        ours = dequantize(raw, qtype.value, (rows, cols)).numpy()
    ref = ref.astype(np.float32)
    assert ours.shape == ref.shape
    # NaNs compare unequal; compare the bit patterns, which also pins down NaN payloads.
    assert _same_bits(ours, ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_with_finite_constants(qtype: T) -> None:
    """Every code pattern, several rows of several (super-)blocks: gguf's bits exactly (the same
    products in the same order: ``(d * s) * q - dmin * m``)."""
    rows, cols = 5, 3 * 256
    raw = _random_blocks(qtype, rows, cols, seed=qtype.value)
    ref = quants.dequantize(raw, qtype)
    ours = dequantize(raw, qtype.value, (rows, cols)).numpy()
    assert ours.shape == (rows, cols) and np.isfinite(ours).all()
    assert _same_bits(ours, ref)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_of_real_weights(qtype: T) -> None:
    """gguf has no K-quant encoder: tests/kquant_blocks.py encodes float weights from llama.cpp's
    layout. gguf decodes those bytes to exactly the values the encoder meant (the layout is
    right), llmlib to the same bits, and the values are close to the weights."""
    rng = np.random.default_rng(qtype.value)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    x[1] += 0.04  # a row that is mostly positive: the minimums matter
    x[2, :256] = 0.0  # an all-zero super-block
    raw, meant = encode_with_values(x, qtype.name)
    ref = quants.dequantize(raw, qtype)
    assert np.array_equal(ref, meant)  # values: the encoder's own zeros may be -0.0
    ours = dequantize(raw, qtype.value, x.shape).numpy()
    assert _same_bits(ours, ref)
    assert not ours[2, :256].any()
    bits = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[qtype]
    rms = np.sqrt(((ours - x) ** 2).mean()) / np.sqrt((x**2).mean())
    assert rms < 2.5 * 2.0**-bits, rms  # each bit halves the error (plain min/max encoders)


def test_q4_nibble_order() -> None:
    """Byte j carries element j (low nibble) and element j+16 (high nibble)."""
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[2] = 0x9 | (0xF << 4)  # element 0 = 9, element 16 = 15
    out = dequantize(block, T.Q4_0.value, (32,))
    assert out[0].item() == 1.0 and out[16].item() == 7.0 and out[1].item() == -8.0


def test_q6_k_bit_positions() -> None:
    """One Q6_K super-block written by hand: ql byte 64 h + i holds weight 128 h + i (low nibble)
    and 128 h + 64 + i (high); qh byte 32 h + i holds weight 128 h + 32 k + i in bits 2k, 2k+1."""
    block = np.zeros(210, dtype=np.uint8)
    block[208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[192:208] = 1  # every sub-block scale 1: x = q - 32
    block[64 + 3] = 0x5A  # weight 131 low 4 bits 10, weight 195 low 4 bits 5
    block[128 + 32 + 3] = 0b10_01_11_00  # weight 131 top bits 0, 163: 3, 195: 1, 227: 2
    out = dequantize(block, T.Q6_K.value, (256,)).numpy()
    expect = np.full(256, -32.0, np.float32)
    expect[[131, 163, 195, 227]] = [10 - 32, 48 - 32, 5 + 16 - 32, 32 - 32]
    assert np.array_equal(out, expect)


def test_unknown_type_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"blk\.3\.ffn_down\.weight: GGUF type IQ2_XS \(id 17\) cannot be read"
    ):
        dequantize(np.zeros(74, np.uint8), T.IQ2_XS.value, (256,), name="blk.3.ffn_down.weight")
    with pytest.raises(ValueError, match=r"x: GGUF type IQ4_NL \(id 20\).*Q6_K"):
        block_format(T.IQ4_NL.value, "x")
    with pytest.raises(ValueError, match=r"w: GGUF type TQ1_0"):
        block_codes("TQ1_0", torch.zeros(1, 54, dtype=torch.uint8), "w")
    with pytest.raises(ValueError, match=r"<unknown> \(id 99\)"):
        block_format(99)


def test_wrong_byte_count_is_named() -> None:
    with pytest.raises(ValueError, match=r"token_embd\.weight.*needs 68 bytes, found 60"):
        dequantize(np.zeros(60, np.uint8), T.Q8_0.value, (2, 32), name="token_embd.weight")
    with pytest.raises(ValueError, match="not a multiple"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0.value, (1, 30), name="w")
    with pytest.raises(ValueError, match=r"Q4_K block size 256"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K.value, (2, 128), name="w")


# ---- codes ------------------------------------------------------------------------------------


def _rounding_bound(c, ref: torch.Tensor) -> torch.Tensor:
    """How far 4-bit codes of a format with a minimum may be from the file's values: the codes
    compute ``(q - 8) * s + z`` with ``z = 8 s - m'`` where the file computes ``q * s - m'``.
    Both products are exact (at most 17 + 4 significant bits), so the difference is the float32
    rounding of ``z`` (half a unit in its last place, ``2**-24 |z|``) and of the two sums (each
    ``2**-24`` of the result); 2**-22 of ``|z| + |x|`` covers it with room."""
    z = c.zero.repeat_interleave(c.group_size, dim=1)
    return 2.0**-22 * (z.abs() + ref.abs())


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("spread", [1.0, 2.0**-12], ids=["like", "far"])
def test_block_codes_are_the_files_values(qtype: T, spread: float) -> None:
    """``block_codes(...).dequantize()`` is the reference dequantization: equal for the 8-bit
    codes and Q4_0 (the same arithmetic), within float32 rounding for Q4_1/Q4_K (their zero
    point is a sum, see :func:`_rounding_bound`). ``far``: minimums 2**-12 of the scales in
    size, so that Q4_K's sum rounds; ``like``: similar sizes, so that it mostly does not."""
    rows, cols = 6, 2 * 256
    raw = _random_blocks(qtype, rows, cols, seed=qtype.value + 100, spread=spread)
    ref = dequantize(raw, qtype.value, (rows, cols))
    c = block_codes(qtype.name, torch.from_numpy(raw), "w")
    assert (c.bits, c.group_size) == KINDS[qtype]
    assert c.q.dtype == torch.uint8 and tuple(c.q.shape) == (rows, cols)
    assert int(c.q.max()) < 2**c.bits
    assert c.scale.dtype == c.zero.dtype == torch.float32
    assert tuple(c.scale.shape) == tuple(c.zero.shape) == (rows, cols // c.group_size)
    got = c.dequantize()
    if qtype in (T.Q4_1, T.Q4_K):
        assert ((got - ref).abs() <= _rounding_bound(c, ref)).all()
    else:
        assert torch.equal(got, ref)  # every value (a zero's sign aside: -0.0 == 0.0)
    # the codes are the file's integers: x = (c - offset) * s + z, with s and z per group
    if qtype == T.Q8_0:
        assert torch.equal(c.q.view(-1, 32), torch.from_numpy(raw.reshape(-1, 34)[:, 2:] ^ 0x80))
    if qtype == T.Q4_0:
        assert not c.zero.any()


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_block_codes_of_real_k_quants(qtype: T) -> None:
    x = (np.random.default_rng(1).standard_normal((8, 768)) * 0.02).astype(np.float32)
    raw, _ = encode_with_values(x, qtype.name)
    ref = dequantize(raw, qtype.value, x.shape)
    c = block_codes(qtype.name, torch.from_numpy(raw))
    got = c.dequantize()
    if qtype == T.Q4_K:
        assert ((got - ref).abs() <= _rounding_bound(c, ref)).all()
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_types_have_no_codes(qtype: T) -> None:
    with pytest.raises(ValueError, match=rf"output\.weight: {qtype.name} is a float type"):
        block_codes(qtype.name, torch.zeros(2, 64, dtype=torch.uint8), "output.weight")


def test_block_codes_read_a_read_only_memory_map_without_copying_it(tmp_path) -> None:
    raw = _random_blocks(T.Q6_K, 4, 512, seed=3)
    path = tmp_path / "raw.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r").reshape(raw.shape)
    with pytest.warns(UserWarning, match="not writable"):  # torch's note on a read-only array
        t = torch.from_numpy(mm)
    got = block_codes("Q6_K", t).dequantize()
    assert torch.equal(got, dequantize(raw, T.Q6_K.value, (4, 512)))


def _blocks(types: dict[str, T], cols: int = 512, rows: int = 64) -> dict:
    out = {}
    for i, (name, qtype) in enumerate(types.items()):
        raw = _random_blocks(qtype, rows // (2 if ".wk." in name else 1), cols, seed=i)
        out[name] = (qtype.name, torch.from_numpy(raw))
    return out


def test_mixed_fused_projections_fuse_exactly() -> None:
    """A Q4_K_M layer: q/k in Q4_K, v in Q6_K -> parts kept apart, or one 6-bit, group-16 qkv
    matrix whose every value is its part's own; gate Q4_K + up Q5_0 -> 6-bit, group 32; a float
    part -> dense."""
    layer = {
        "layers.0.attn.wq.weight": T.Q4_K,
        "layers.0.attn.wk.weight": T.Q4_K,
        "layers.0.attn.wv.weight": T.Q6_K,
        "layers.0.ffn.w_gate.weight": T.Q4_K,
        "layers.0.ffn.w_up.weight": T.Q5_0,
        "layers.0.ffn.w_down.weight": T.Q6_K,
        "layers.1.attn.wq.weight": T.Q4_K,
        "layers.1.attn.wk.weight": T.Q4_0,
        "layers.1.attn.wv.weight": T.Q4_1,
    }
    blocks = _blocks(layer)  # layers.1's v is missing from blocks below: a float part
    blocks_1_v = blocks.pop("layers.1.attn.wv.weight")
    mods = ["layers.0.attn.wqkv", "layers.0.ffn.w_gate_up", "layers.0.ffn.w_down"]
    mods += ["layers.1.attn.wqkv"]
    codes = model_codes(mods, blocks)
    assert set(codes) == set(mods) - {"layers.1.attn.wqkv"}  # the float part: stays dense
    # parts of different kinds stay apart; fused, they take the widest kind
    assert isinstance(codes[mods[0]], CodeParts) and isinstance(codes[mods[1]], CodeParts)
    kinds = {m: (c.bits, c.group_size) for m, c in codes.items() if isinstance(c, GroupCodes)}
    kinds |= {m: (c.fused().bits, c.fused().group_size) for m, c in codes.items() if m not in kinds}
    assert kinds == {mods[0]: (6, 16), mods[1]: (6, 32), mods[2]: (6, 16)}
    for mod, parts in [(mods[0], ("wq", "wk", "wv")), (mods[1], ("w_gate", "w_up"))]:
        sub = "attn" if "attn" in mod else "ffn"
        own = [block_codes(*blocks[f"layers.0.{sub}.{p}.weight"]) for p in parts]
        assert [(c.bits, c.group_size) for c in codes[mod].parts] == [
            (c.bits, c.group_size) for c in own
        ]
        # exact: the same codes minus the same offset, times the same scale, plus the same zero
        want = torch.cat([c.dequantize() for c in own])
        assert torch.equal(codes[mod].dequantize(), want)
        assert torch.equal(codes[mod].fused().dequantize(), want)
    # all-4-bit parts stay 4-bit (the int4 kernels' layout)
    blocks["layers.1.attn.wv.weight"] = blocks_1_v
    four = model_codes(["layers.1.attn.wqkv"], blocks)["layers.1.attn.wqkv"]
    assert (four.bits, four.group_size) == (4, 32)


def test_fuse_widens_codes_by_the_offsets() -> None:
    a = block_codes(*_blocks({"a": T.Q4_K}, rows=2)["a"])
    b = block_codes(*_blocks({"b": T.Q3_K}, rows=2)["b"])
    f = fuse([a, b]).fused()
    assert (f.bits, f.group_size) == (6, 16)
    assert torch.equal(f.q[:2], a.q + 24)  # 4-bit code c: c - 8 == (c + 24) - 32
    assert torch.equal(f.scale[:2, ::2], a.scale) and torch.equal(f.scale[:2, 1::2], a.scale)
    assert torch.equal(f.zero[:2], a.zero.repeat_interleave(2, dim=1))
    assert fuse([a]) is a and fuse([a, a]).shape == (4, a.shape[1])  # one kind: one matrix


def test_repack_error_covers_every_block_type() -> None:
    blocks = {f"m{t.name}": (t.name, torch.from_numpy(_random_blocks(t, 4, 256, 7))) for t in KINDS}
    err = repack_error(blocks, torch.bfloat16)
    assert set(err) == {t.name for t in KINDS}
    for kind, e in err.items():
        assert e["tensors"] == 1
        assert e["codes"] < 2**-20, kind  # exact, or float32 rounding (Q4_1, Q4_K)
        assert e["in_dtype"] < 2**-6, kind  # the constants in bfloat16: 8 significant bits
