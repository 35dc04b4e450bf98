"""llmlib.quant against the reference dequantizer in the `gguf` package, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from kquant_blocks import encode_with_values

from llmlib.checkpoints.quant import FORMATS, block_format, dequantize
from llmlib.gguf_file import GGML_TYPES

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
        block_format("TQ1_0", "w")
    with pytest.raises(ValueError, match=r"<unknown> \(id 99\)"):
        block_format(99)


def test_wrong_byte_count_is_named() -> None:
    with pytest.raises(ValueError, match=r"token_embd\.weight.*needs 68 bytes, found 60"):
        dequantize(np.zeros(60, np.uint8), T.Q8_0.value, (2, 32), name="token_embd.weight")
    with pytest.raises(ValueError, match="not a multiple"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0.value, (1, 30), name="w")
    with pytest.raises(ValueError, match=r"Q4_K block size 256"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K.value, (2, 128), name="w")
