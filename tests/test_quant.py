"""llmlib.quant against the reference dequantizer in the `gguf` package, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from llmlib.checkpoints.quant import FORMATS, block_format, dequantize

SUPPORTED = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_formats_match_gguf_sizes() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert {T(f.type_id) for f in FORMATS.values()} == set(SUPPORTED)
    for f in FORMATS.values():
        assert GGML_QUANT_SIZES[T(f.type_id)] == (f.block_size, f.block_bytes), f.name
        assert T(f.type_id).name == f.name
    assert block_format(T.Q4_1).bits_per_weight == 5.0


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
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


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.BF16, T.F16], ids=lambda t: t.name)
def test_dequantize_arbitrary_random_blocks(qtype: T) -> None:
    """Random bytes (any scale, any nibble, NaN/inf patterns included) decode exactly as gguf does."""
    f = block_format(qtype.value)
    rng = np.random.default_rng(qtype.value)
    rows, cols = 7, 4 * 32
    raw = rng.integers(0, 256, size=(rows, cols // f.block_size * f.block_bytes), dtype=np.uint8)
    ref = (
        quants.dequantize(raw, qtype) if qtype != T.F16 else raw.view(np.float16).astype(np.float32)
    )
    ours = dequantize(raw, qtype.value, (rows, cols)).numpy()
    assert ours.shape == ref.shape
    # NaNs compare unequal; compare the bit patterns, which also pins down NaN payloads.
    assert _same_bits(ours, ref)


def test_q4_nibble_order() -> None:
    """Byte j carries element j (low nibble) and element j+16 (high nibble)."""
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[2] = 0x9 | (0xF << 4)  # element 0 = 9, element 16 = 15
    out = dequantize(block, T.Q4_0.value, (32,))
    assert out[0].item() == 1.0 and out[16].item() == 7.0 and out[1].item() == -8.0


def test_unknown_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q5_0"):
        dequantize(np.zeros(22, np.uint8), T.Q5_0.value, (32,), name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="Q4_K"):
        block_format(T.Q4_K.value, "x")


def test_wrong_byte_count_is_named() -> None:
    with pytest.raises(ValueError, match=r"token_embd\.weight.*needs 68 bytes, found 60"):
        dequantize(np.zeros(60, np.uint8), T.Q8_0.value, (2, 32), name="token_embd.weight")
    with pytest.raises(ValueError, match="not a multiple"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0.value, (1, 30), name="w")
