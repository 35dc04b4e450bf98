"""The integer int8/int4/8-bit-group kernels (llmlib.kernels.integer): layouts, products against the same
arithmetic in float64, the rows of a tied table, and a model stored for them at load."""

from __future__ import annotations

import pytest
import torch
from test_gguf import TINY

from llmlib.kernels import integer as vnni
from llmlib.kernels import native
from llmlib.kernels.flags import forced
from llmlib.kernels.prepare import Format, pack_codes, quantize_model, weight_matrices
from llmlib.kernels.weights import Int4Weight, Int8Weight
from llmlib.model import random_model
from llmlib.quantize import GroupCodes, quantize_int4, quantize_int8

needs_kernels = pytest.mark.skipif(
    not vnni.available(), reason="no AVX-512 VNNI or AVX2 here (or no compiler): PyTorch's serve"
)


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _codes8(
    n: int,
    k: int,
    group: int,
    seed: int = 0,
    half: bool = False,
    offsets: bool = True,
    units: bool = False,
) -> GroupCodes:
    """8-bit codes in groups, as a GGUF file's are once repacked: every code 0..255, a scale and
    an offset per group; ``half``: constants float16 holds exactly (Q8_0's, Q5_1's), else ones it
    does not; ``offsets=False``: every offset zero (Q8_0, Q6_K); ``units``: the scales are a
    float16 unit per 256 columns times an int8 per group (a k-quant's, Q6_K's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // group, generator=gen) * 0.05 * offsets
    if half:
        scale, zero = scale.half().float(), zero.half().float()
    unit = ints = None
    if units:
        unit = (torch.rand(n, k // 256, generator=gen) * 1e-3 + 1e-4).half().float()
        unit[0, 0] = 0.0  # an all-zero block (d = 0) is a real file's too
        ints = torch.randint(-128, 128, (n, k // group), generator=gen).to(torch.int8)
        scale = unit.repeat_interleave(256 // group, dim=1) * ints.float()
    return GroupCodes(q, scale, zero, group, bits=8, unit=unit, steps=ints)


def test_int8_tiles_read_back_to_the_codes() -> None:
    q = quantize_int8(_w(128, 96)).q
    tiles = vnni.pack_int8(q)
    assert tiles.shape == (2, 96 * 64) and tiles.dtype == torch.uint8
    ids = torch.tensor([[0, 63], [64, 127]])
    assert torch.equal(vnni.unpack_int8(tiles, 96, ids), q[ids])
    # four consecutive codes of one channel lie side by side, the next channel's after them
    assert (
        tiles[0, :8].tolist() == (q[0, :4].int() + 128).tolist() + (q[1, :4].int() + 128).tolist()
    )


def test_int4_tiles_read_back_to_the_codes() -> None:
    q = quantize_int4(_w(128, 64), 32).q
    tiles = vnni.pack_int4(q)
    assert tiles.shape == (2, 64 * 32)
    ids = torch.arange(128)
    assert torch.equal(vnni.unpack_int4(tiles, 64, ids), q)
    # byte 0: channel 0's column 0 in the low nibble and column 4 in the high one
    assert tiles[0, 0].item() == q[0, 0].item() | q[0, 4].item() << 4


def test_int8_group_tiles_read_back_to_the_codes() -> None:
    codes = _codes8(128, 96, 32)
    tiles = vnni.pack_uint8(codes.q)
    # the same tiles as int8's: the codes already carry the + 128
    assert torch.equal(tiles, vnni.pack_int8((codes.q.to(torch.int16) - 128).to(torch.int8)))
    ids = torch.tensor([[0, 63], [64, 127]])
    assert torch.equal(vnni.unpack_int8(tiles, 96, ids), (codes.q[ids].int() - 128).to(torch.int8))


def test_shapes_that_fit() -> None:
    assert vnni.fits((576, 1536)) and vnni.fits((960, 576), 32) and vnni.fits((3072, 576), 64)
    assert not vnni.fits((80, 64)) and not vnni.fits((128, 48)) and not vnni.fits((128, 64), 16)
    # 8-bit codes also come in groups of 16 (Q6_K, Q3_K, Q2_K): two to an activation block
    assert vnni.fits((128, 64), 16, bits=8) and vnni.fits((49152, 576), 32, bits=8)
    assert not vnni.fits((128, 64), 8, bits=8) and not vnni.fits((128, 96), 64, bits=8)


def _round_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation rounding, in PyTorch: int8 codes and a scale per 32 values."""
    b = x.float().view(x.shape[0], -1, 32)
    d = b.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(b * inv[..., None]), d


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_is_its_arithmetic(dtype) -> None:
    codes = quantize_int8(_w(192, 160))
    w = vnni.VnniInt8Weight(codes, dtype)
    x = torch.randn(5, 160).to(dtype)
    xq, d = _round_rows(x)
    blocks = xq.double().view(5, -1, 32)
    qw = codes.q.double().view(192, -1, 32)
    want = torch.einsum("mbi,nbi,mb->mn", blocks, qw, d.double()) * codes.scale.double()
    got = w.linear(x)
    assert got.dtype == dtype and got.shape == (5, 192)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # and close to the float product of the weights' codes: the activations' rounding only
    ref = x.double() @ codes.dequantize().double().T
    assert (got.double() - ref).norm() / ref.norm() < 2e-2


@needs_kernels
@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_is_its_arithmetic(group) -> None:
    codes = quantize_int4(_w(128, 128, seed=1), group)
    w = vnni.VnniInt4Weight(codes, torch.float32)
    x = torch.randn(3, 128)
    xq, dx = _round_rows(x)
    d = codes.scale.half().double()  # stored in float16, as the kernel reads them
    m = (codes.zero - 8 * codes.scale).half().double()
    wq = codes.q.double() * d.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
    want = torch.einsum(
        "mbi,nbi,mb->mn", xq.double().view(3, -1, 32), wq.view(128, -1, 32), dx.double()
    )
    torch.testing.assert_close(
        w.linear(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
    )
    # rows() reads back what the kernel multiplies (the embedding lookup of a tied table)
    torch.testing.assert_close(
        w.rows(torch.tensor([0, 77])).double(), wq[[0, 77]], rtol=1e-6, atol=1e-6
    )


@needs_kernels
@pytest.mark.parametrize(
    "group, dtype, offsets, units",
    [
        (32, torch.float32, True, False),
        (32, torch.bfloat16, True, False),
        (32, torch.float32, False, False),
        (16, torch.float32, True, False),
        (16, torch.bfloat16, True, False),
        (16, torch.float32, False, False),
        (64, torch.float32, True, False),
        (16, torch.float32, False, True),
        (16, torch.bfloat16, False, True),
        (32, torch.float32, True, True),
    ],
)
def test_int8_group_kernel_is_its_arithmetic(group, dtype, offsets, units) -> None:
    """With offsets (Q5_1's) and without (Q8_0's, Q6_K's: the kernel skips their terms); with
    scales kept as an int8 per group times a float unit per 256 columns (k-quants')."""
    n, k, rows = 192, 160 if group != 64 else 192, 5
    if units:
        k = 512
    half = group == 32 and not units  # Q8_0's float16 constants; the others' float32 ones
    codes = _codes8(n, k, group, seed=group, half=half, offsets=offsets, units=units)
    w = vnni.VnniInt8GroupWeight(codes, dtype)
    assert w.has_offsets == offsets
    if units:  # 1 byte a group and 4 per 256 columns, not a float32 a group
        assert w.d.dtype == torch.int8 and w.u.shape == (n // 64, k // 256 * 64)
        assert w.m.dtype == torch.float32
    else:
        assert w.d.dtype == (torch.float16 if half else torch.float32) and w.m.dtype == w.d.dtype
        assert w.u.numel() == 0
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    xq, dx = _round_rows(x)
    wq = codes.dequantize().double()  # the constants as stored: exactly, in either dtype
    want = torch.einsum(
        "mbi,nbi,mb->mn", xq.double().view(rows, -1, 32), wq.view(n, -1, 32), dx.double()
    )
    got = w.linear(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # and close to the float product of the weights: the activations' rounding only
    ref = x.double() @ wq.T
    assert (got.double() - ref).norm() / ref.norm() < 2e-2
    # rows() reads back what the kernel multiplies (the embedding lookup of a tied table)
    ids = torch.tensor([[0, 77], [191, 64]])
    assert torch.equal(w.rows(ids), codes.dequantize()[ids].to(dtype))
    assert torch.equal(w.dequantize(), codes.dequantize().to(dtype))


def _codes6(n: int, k: int, group: int, seed: int = 0, offsets: bool = False, units: bool = True):
    """6-bit codes in groups (``q`` in -32..31, stored plus 32): a Q6_K matrix's once repacked,
    with its factored scales (``units``) and no offsets."""
    c = _codes8(n, k, group, seed=seed, offsets=offsets, units=units)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randint(0, 64, (n, k), generator=gen).to(torch.uint8)
    return GroupCodes(q, c.scale, c.zero, group, 6, c.unit, c.steps)


def test_int6_tiles_read_back_to_the_codes() -> None:
    codes = _codes6(128, 512, 16)
    w = vnni.pack_int6(codes.q)
    assert w.shape == (2, 512 * 48) and w.dtype == torch.uint8  # six bits a weight
    ids = torch.tensor([[0, 1, 17], [63, 64, 127]])
    assert torch.equal(vnni.unpack_int6(w, 512, ids), codes.q[ids])
    wide = vnni.eight_bit(codes)
    assert wide.bits == 8 and torch.equal(wide.dequantize(), codes.dequantize())


@needs_kernels
@pytest.mark.parametrize(
    "group, dtype, offsets, units",
    [
        (16, torch.float32, False, True),  # Q6_K
        (16, torch.bfloat16, False, True),
        (32, torch.float32, False, False),  # Q5_0
        (16, torch.float32, True, False),
        (64, torch.bfloat16, True, True),
    ],
)
@pytest.mark.parametrize("rows", [5, 19])
def test_int6_group_kernel_is_its_arithmetic(group, dtype, offsets, units, rows) -> None:
    """The 6-bit layout multiplies exactly what the 8-bit one does with the same codes: the same
    integer sums (each less its offset times the activations' sum), so the same floats. From 16
    rows on its tiles are widened to 8-bit ones first: the same bits again."""
    n, k = 192, 512
    codes = _codes6(n, k, group, seed=group, offsets=offsets, units=units)
    w6 = vnni.VnniInt6Weight(codes, dtype)
    w8 = vnni.VnniInt8GroupWeight(codes, dtype)
    assert w6.w.numel() * 4 == w8.w.numel() * 3 and w6.has_offsets == offsets
    assert w6.d.dtype == w8.d.dtype and w6.m.dtype == w8.m.dtype
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = w6.linear(x)
    assert got.dtype == dtype and torch.equal(got, w8.linear(x))
    xq, dx = _round_rows(x)
    wq = codes.dequantize().double()
    want = torch.einsum(
        "mbi,nbi,mb->mn", xq.double().view(rows, -1, 32), wq.view(n, -1, 32), dx.double()
    )
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    ids = torch.tensor([[0, 77], [191, 64]])
    assert torch.equal(w6.rows(ids), codes.dequantize()[ids].to(dtype))
    for i in range(rows):  # a row's result does not depend on its batch
        assert torch.equal(w6.linear(x[i : i + 1])[0], got[i])


@needs_kernels
def test_a_q6_k_matrix_is_held_in_its_own_bytes() -> None:
    """A Q6_K matrix from a file's bytes: packed six bits a weight (the file's 210 bytes per 256
    weights, within 1%), and its weights the ``gguf`` package's decoding of those bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    from kquant_blocks import encode

    from llmlib.checkpoints.repack import block_codes

    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(3)).numpy()
    raw = encode(x, "Q6_K")
    codes = block_codes("Q6_K", torch.from_numpy(raw), "blk.0.ffn_down.weight")
    w = vnni.pack(codes, torch.float32)
    assert isinstance(w, vnni.VnniInt6Weight) and w.label.startswith("int6 g16 ")
    ref = torch.from_numpy(dequantize(raw, T.Q6_K).astype(np.float32))
    assert torch.equal(w.dequantize(), ref)
    assert w.nbytes <= 1.01 * raw.nbytes  # six bits, an int8 per 16 and a float32 per 256
    with forced(six_bit=False):
        assert isinstance(vnni.pack(codes, torch.float32), vnni.VnniInt8GroupWeight)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q4_k_matrix_keeps_its_constants_factored(dtype) -> None:
    """A Q4_K matrix from a file's bytes: its 6-bit scales and minimums kept as a byte per group
    and its d and dmin as float16 per 256 weights (4.625 bits a weight against the file's 4.5,
    not 5), its weights the ``gguf`` package's decoding, its product that arithmetic's."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    from kquant_blocks import encode

    from llmlib.checkpoints.repack import block_codes

    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(4)).numpy()
    raw = encode(x, "Q4_K")
    codes = block_codes("Q4_K", torch.from_numpy(raw), "blk.0.ffn_up.weight")
    w = vnni.pack(codes, dtype)
    assert isinstance(w, vnni.VnniInt4Weight) and w.d.dtype == torch.int8 and w.du.numel()
    ref = torch.from_numpy(dequantize(raw, T.Q4_K).astype(np.float32))
    torch.testing.assert_close(w.dequantize().float(), ref.to(dtype).float(), rtol=0, atol=1e-6)
    assert w.nbytes <= 1.03 * raw.nbytes
    rows = 3
    a = torch.randn(rows, 512, generator=torch.Generator().manual_seed(5)).to(dtype)
    aq, da = _round_rows(a)
    want = torch.einsum(
        "mbi,nbi,mb->mn",
        aq.double().view(rows, -1, 32),
        ref.double().view(128, -1, 32),
        da.double(),
    )
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    got = w.linear(a).double()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    for i in range(rows):
        assert torch.equal(w.linear(a[i : i + 1])[0], w.linear(a)[i])


@needs_kernels
def test_8_bit_group_codes_pack_for_the_kernel() -> None:
    for group in (32, 16):
        codes = _codes8(128, 64, group)
        w = vnni.pack(codes, torch.bfloat16)
        assert isinstance(w, vnni.VnniInt8GroupWeight) and w.label.startswith(f"int8 g{group} ")
        fmt = Format(torch.device("cpu"), torch.bfloat16, "gguf")
        assert isinstance(pack_codes(codes, fmt, rows=True), vnni.VnniInt8GroupWeight)
    # a byte a weight, and a Q8_0 block's constants in float16: little more than half the bytes
    # of the dense bfloat16 matrix this replaces
    q8_0 = vnni.pack(_codes8(128, 64, 32, half=True), torch.bfloat16)
    assert q8_0.d.dtype == torch.float16 and q8_0.nbytes == 128 * 64 + 2 * 128 * 2 * 2
    # a shape the tiles do not fit stays dense, as before
    assert vnni.pack(_codes8(80, 64, 32), torch.bfloat16) is None
    with forced(integer="off"):
        dense = pack_codes(
            _codes8(128, 64, 32), Format(torch.device("cpu"), torch.bfloat16, "gguf")
        )
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("build", ["avx512vnni", "avx2"])
def test_labels_name_the_build_of_the_kernels_that_runs(build: str, monkeypatch) -> None:
    """The timing line must not say VNNI on a CPU that reads the tiles with AVX2 (one process
    loads one build, so the build that runs is stood in for once the weights are made)."""
    w8 = vnni.VnniInt8Weight(quantize_int8(_w(64, 64)), torch.float32)
    w4 = vnni.VnniInt4Weight(quantize_int4(_w(64, 64), 32), torch.float32)
    w8g = vnni.VnniInt8GroupWeight(_codes8(64, 64, 16), torch.float32)
    monkeypatch.setattr(vnni, "isa", lambda: build)
    name = {"avx512vnni": "vnni", "avx2": "avx2"}[build]
    assert [w8.label, w4.label, w8g.label] == [
        f"int8 {name}",
        f"int4 g32 {name}",
        f"int8 g16 {name}",
    ]


@needs_kernels
def test_dtype_moves_change_the_activations_only() -> None:
    w = vnni.VnniInt8Weight(quantize_int8(_w(64, 64)), torch.float32)
    w.to(torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.scale.dtype == torch.float32 and w.w.dtype == torch.uint8
    assert w.linear(torch.randn(2, 64).to(torch.bfloat16)).dtype == torch.bfloat16
    assert w.linear(torch.randn(2, 64).half()).dtype == torch.float16  # through float32
    with pytest.raises(RuntimeError, match="laid out for this CPU"):
        w.to("meta")


@needs_kernels
def test_kernels_inside_torch_compile() -> None:
    x = torch.randn(2, 64)
    w4 = vnni.VnniInt4Weight(quantize_int4(_w(64, 64), 32), torch.float32)
    w8g = vnni.VnniInt8GroupWeight(_codes8(64, 64, 16), torch.float32)
    for w in (w4, w8g):
        f = torch.compile(
            lambda t, w=w: torch.relu(w.linear(t)), backend="aot_eager", fullgraph=True
        )
        torch.testing.assert_close(f(x), torch.relu(w.linear(x)))


@needs_kernels
def test_quantized_model_stored_for_the_kernels() -> None:
    cfg = TINY.replace(d_model=64, ffn_dim=128, vocab_size=128, tie_embeddings=True)
    with forced(integer="off"):  # PyTorch's weight-only layouts: the reference
        ref = quantize_model(random_model(cfg, "cpu", torch.bfloat16), "int4")
    assert {type(m.weight) for m in weight_matrices(ref).values()} == {Int4Weight, Int8Weight}
    model = quantize_model(random_model(cfg, "cpu", torch.bfloat16), "int4")
    kinds = {type(m.weight) for m in weight_matrices(model).values()}
    assert kinds == {vnni.VnniInt4Weight, vnni.VnniInt8Weight}  # int4 keeps the tied head in int8
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        a, b = model(ids).float(), ref(ids).float()
    assert (a - b).norm() / b.norm() < 5e-2  # the same codes; the activations are rounded too
    # a matrix the tiles do not fit keeps PyTorch's kernel
    odd = quantize_model(random_model(TINY.replace(ffn_dim=80), "cpu", torch.bfloat16), "int8")
    downs = [m.weight for n, m in weight_matrices(odd).items() if n.endswith("w_down")]
    assert all(isinstance(w, Int8Weight) for w in downs)
    assert not any(isinstance(m.weight, Int4Weight) for m in weight_matrices(odd).values())


def test_without_the_kernels_pytorchs_serve(monkeypatch) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "_built", lambda name: None)  # as on a machine without it
    with pytest.warns(UserWarning, match="no c..? compiler"):
        assert (
            vnni._load.__wrapped__(vnni.isa() or "avx2") is False
        )  # the build itself, past the cache
    with forced(integer="off"):
        assert not vnni.available()
        model = quantize_model(random_model(TINY, "cpu", torch.bfloat16), "int8")
    assert all(isinstance(m.weight, Int8Weight) for m in weight_matrices(model).values())


@needs_kernels
def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    # rows go through the kernels in pairs, the last one alone: the same sums in the same order
    w8 = vnni.VnniInt8Weight(quantize_int8(_w(128, 96)), torch.bfloat16)
    w4 = vnni.VnniInt4Weight(quantize_int4(_w(128, 96), 32), torch.bfloat16)
    w8g = [vnni.VnniInt8GroupWeight(_codes8(128, 96, g), torch.bfloat16) for g in (32, 16)]
    x = torch.randn(5, 96).to(torch.bfloat16)
    for w in (w8, w4, *w8g):
        batch = w.linear(x)
        for i in range(5):
            assert torch.equal(w.linear(x[i : i + 1])[0], batch[i])


@pytest.mark.skipif(
    vnni.isa() != "avx512vnni" or not native.has_avx2(),
    reason="runs the AVX2 build where the AVX-512 one is the default (elsewhere the tests above do)",
)
def test_the_avx2_build_is_its_arithmetic_too() -> None:
    # the same source, its other half: built for AVX2 in a process that asks for it
    import os
    import subprocess
    import sys

    env = {**os.environ, "LLMLIB_NATIVE_ISA": "avx2"}
    tests = "(arithmetic or does_not_depend or stored_for_the_kernels or q4_k or q6_k) and not avx2_build"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("29 passed") and "skipped" not in last, run.stdout[-2000:]
