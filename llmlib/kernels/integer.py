"""int8 and int4 weights multiplied by integer dot products (AVX-512 VNNI, or AVX2): the
activations are rounded to int8 in blocks of 32, as llama.cpp does.

PyTorch's CPU weight-only kernels (:class:`llmlib.kernels.weights.Int8Weight`, ``Int4Weight``)
turn each code into a float before multiplying, so at many rows (a prefill chunk, a batch) they
are bound by float arithmetic. VNNI multiplies bytes by bytes, 64 pairs per instruction into 16
int32 sums (AVX2 needs two instructions for 32 pairs), but only if both sides are integers. So
each block of 32 activations becomes int8 codes and one scale (``max|x| / 127``), and each
block's integer sum is scaled back by both scales. That adds the activations' rounding error,
which ``llmlib bench batching`` measures as perplexity against float32 beside each format's speed.

Every int8, int4 and gguf CPU matrix takes them where they run and fit, eager or compiled (extern
operators in the graph): :func:`llmlib.kernels.prepare.prepare` decides at load.
``LLMLIB_INTEGER=0`` keeps PyTorch's layouts, the reference the tests compare these with.

The kernels are C++ (``llmlib/kernels/csrc/vnni.cpp``), loaded as
``torch.ops.llmlib_vnni.int8_linear`` / ``int4_linear`` / ``int8g_linear`` / ``int6_linear``. They need AVX-512
VNNI or AVX2 (:func:`isa`, a build each), a compiler, output widths a multiple of 64 and input
widths (and int4 groups) a multiple of 32 (8-bit groups may be 16). Elsewhere a matrix keeps
PyTorch's kernel (8-bit codes in groups, which PyTorch has none for, become a dense matrix).

Layout (:func:`pack_int8` / :func:`pack_int4`): tiles of 64 output channels; inside a tile, for
each four input columns, the 64 channels' four codes side by side, so one 64-byte load holds
four consecutive codes of 16 channels. int8 codes are stored plus 128 (the instruction's
unsigned operand); int4 codes keep two groups of four columns per byte (low and high nibble),
with each group's ``w = d * q + m`` constants in float16 (or, for Q4_K, a byte each times float16
units per 256 columns: 4.625 bits a weight). 8-bit codes in groups (Q8_0) are int8's tiles with
per-group constants, ``w = d * (u - 128) + m``. 6-bit codes (Q6_K, Q5_x, Q3_K, Q2_K) keep six
bits (:func:`pack_int6`), so a decode step reads about the bytes the file holds.
"""

from __future__ import annotations

import functools

import torch

from llmlib.kernels import native
from llmlib.kernels.flags import flags
from llmlib.kernels.native import AVX512
from llmlib.kernels.tiles import (
    TILE,
    eight_bit,
    pack_int4,
    pack_int6,
    pack_int8,
    pack_uint8,
    tile_constants,
    unpack_int4,
    unpack_int6,
    unpack_int8,
)
from llmlib.kernels.weights import PackedWeight
from llmlib.quantize import ChannelCodes, GroupCodes

BLOCK = 32  # activation values per int8 scale
_NAME = "llmlib_vnni"


def cpu_has_vnni() -> bool:
    """Whether this CPU reports AVX-512 VNNI (with the BW and VL extensions the kernels use)."""
    f = flags()
    return f.isa == "avx512" and f.has_vnni


def _build_name() -> str:
    """The short name of the kernels' build that runs here, for labels: ``vnni`` or ``avx2``."""
    return "vnni" if isa() == "avx512vnni" else "avx2"


def isa() -> str | None:
    """Which build runs here (:attr:`llmlib.kernels.flags.Flags.integer`): ``"avx512vnni"``,
    ``"avx2"`` (``vpmaddubsw`` + ``vpmaddwd`` per byte product) or None (``LLMLIB_INTEGER=0``)."""
    return {"vnni": "avx512vnni", "avx2": "avx2"}.get(flags().integer)


@functools.cache
def _load(which: str) -> bool:
    """Build (once per machine) and load the kernels; False where that fails. Each instruction
    set is its own extension, so a shared cache never hands one CPU the other's."""
    flags = [*AVX512, "-mavx512vnni"] if which == "avx512vnni" else native.AVX2
    if not native.build(f"{_NAME}_{which}", "vnni.cpp", flags, f"{which} int8/int4 kernels"):
        return False
    _register_fakes()
    return True


def available() -> bool:
    """Whether the VNNI kernels can run here (builds them on the first call that needs them)."""
    which = isa()
    return which is not None and _load(which)


def fits(shape: tuple[int, int], group_size: int | None = None, bits: int = 4) -> bool:
    """Whether a ``[out, in]`` matrix (and its group size, of ``bits``-bit codes) has a VNNI
    layout: groups are multiples of 32, or 16 for 6- and 8-bit codes (two to an activation
    block)."""
    n, k = shape
    if n % TILE or k % BLOCK:
        return False
    if group_size is None:
        return True
    whole = group_size % BLOCK == 0 or (bits in (6, 8) and group_size == BLOCK // 2)
    return group_size > 0 and whole and k % group_size == 0


def _register_fakes() -> None:
    # shapes for torch.compile: the operators run as extern calls inside a compiled graph
    @torch.library.register_fake("llmlib_vnni::int8_linear")
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0] * TILE)

    @torch.library.register_fake("llmlib_vnni::int4_linear")
    def _(x, w, d, m, du, mu, group):
        return x.new_empty(x.shape[0], w.shape[0] * TILE)

    @torch.library.register_fake("llmlib_vnni::int8g_linear")
    def _(x, w, d, m, u, group):
        return x.new_empty(x.shape[0], w.shape[0] * TILE)

    @torch.library.register_fake("llmlib_vnni::int6_linear")
    def _(x, w, d, m, u, group):
        return x.new_empty(x.shape[0], w.shape[0] * TILE)


# ---- the weights ----------------------------------------------------------------------------


class VnniWeight(PackedWeight):
    """Shared by both layouts: CPU only; ``.to(dtype)`` changes the activations' dtype (the
    ``act`` marker) and leaves the codes and their constants as the kernel wants them."""

    _constants = "act"

    def __init__(self, shape: tuple[int, int]) -> None:
        if not available():
            raise RuntimeError(
                "the VNNI kernels cannot run here (llmlib.kernels.integer.available() is False)"
            )
        super().__init__(shape)

    def _apply(self, fn, recurse=True):
        act = fn(self.act)
        if act.device.type != "cpu":
            raise RuntimeError(
                f"{self.kind} weights are laid out for this CPU's kernels; load the model on "
                f"{act.device} instead of moving it there"
            )
        self.act = act
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def label(self) -> str:
        """The layout and the build that reads it: ``int8 vnni``, or ``int8 avx2`` (same tiles)."""
        return self.kind.replace("vnni", _build_name())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):  # the kernels take these two
            return super().linear(x.float(), bias).to(x.dtype)
        return super().linear(x, bias)


class VnniInt8Weight(VnniWeight):
    """int8 codes and per-row float32 scales in VNNI tiles: ``llmlib_vnni::int8_linear``."""

    kind = "int8 vnni"

    def __init__(self, codes: ChannelCodes, dtype: torch.dtype) -> None:
        super().__init__(codes.shape)
        self.register_buffer("act", torch.empty(0, dtype=dtype))
        self.register_buffer("w", pack_int8(codes.q).contiguous())
        self.register_buffer("scale", codes.scale.float().contiguous())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmlib_vnni.int8_linear(x, self.w, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = unpack_int8(self.w, self.shape[1], ids)
        return (q.float() * self.scale[ids, None]).to(self.dtype)


class VnniInt4Weight(VnniWeight):
    """4-bit codes in VNNI tiles, ``w = d * q + m`` per group: ``llmlib_vnni::int4_linear``."""

    kind = "int4 vnni"

    def __init__(self, codes: GroupCodes, dtype: torch.dtype) -> None:
        super().__init__(codes.shape)
        self.group_size = codes.group_size
        self.register_buffer("act", torch.empty(0, dtype=dtype))
        self.register_buffer("w", pack_int4(codes.q).contiguous())
        if _factored_4(codes):  # Q4_K: a byte per group for d and m, float16 units per 256
            self.register_buffer("d", tile_constants(codes.steps).contiguous())
            self.register_buffer("m", tile_constants(codes.shift_steps).contiguous())
            self.register_buffer("du", tile_constants(codes.unit.half()).contiguous())
            self.register_buffer("mu", tile_constants(codes.shift_unit.half()).contiguous())
            return
        # GroupCodes' convention is (q - 8) * scale + zero: d = scale, m = zero - 8 * scale
        # (a GGUF Q4_1 block's own d and m, which float16 holds exactly)
        d, m = codes.scale.float(), codes.zero.float() - 8 * codes.scale.float()
        self.register_buffer("d", tile_constants(d.half()).contiguous())
        self.register_buffer("m", tile_constants(m.half()).contiguous())
        self.register_buffer("du", torch.empty(0, dtype=torch.float16))
        self.register_buffer("mu", torch.empty(0, dtype=torch.float16))

    @property
    def label(self) -> str:
        return f"int4 g{self.group_size} {_build_name()}"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        # no units: none, not empty tensors (AOTInductor hands an empty constant over as none)
        du, mu = (self.du, self.mu) if self.du.numel() else (None, None)
        return torch.ops.llmlib_vnni.int4_linear(x, self.w, self.d, self.m, du, mu, self.group_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = unpack_int4(self.w, self.shape[1], ids)
        if not self.du.numel():
            return _group_rows(self, q, ids)
        n, k = self.shape
        g, tiles, lane = self.group_size, ids // TILE, ids % TILE

        def per_column(c: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
            steps = c.view(n // TILE, k // g, TILE)[tiles, :, lane].float()
            units = unit.view(n // TILE, k // UNIT, TILE)[tiles, :, lane].float()
            return (steps * units.repeat_interleave(UNIT // g, dim=-1)).repeat_interleave(g, -1)

        out = q.float() * per_column(self.d, self.du) + per_column(self.m, self.mu)
        return out.to(self.dtype)


def _group_rows(w: PackedWeight, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a matrix of codes in groups, ``d * q + m``, its per-group constants read
    out of their tiles (``[N / 64, K / group * 64]``): the lookup of a tied table."""
    n, k = w.shape
    g = w.group_size
    tiles, lane = ids // TILE, ids % TILE
    d = w.d.view(n // TILE, k // g, TILE)[tiles, :, lane].float()
    if w.m.numel():
        m = w.m.view(n // TILE, k // g, TILE)[tiles, :, lane].float()
    else:  # no offsets stored (Q8_0, Q6_K)
        m = torch.zeros_like(d)
    u = getattr(w, "u", None)
    if u is not None and u.numel():  # int8 integers times a float unit per 256 columns
        unit = u.view(n // TILE, k // UNIT, TILE)[tiles, :, lane]
        d = d * unit.repeat_interleave(UNIT // g, dim=-1)
    out = q.float() * d.repeat_interleave(g, dim=-1) + m.repeat_interleave(g, dim=-1)
    return out.to(w.dtype)


#: columns per float unit of factored constants (a k-quant super-block: ``GroupCodes.unit``)
UNIT = GroupCodes.UNIT


def _factored(codes: GroupCodes) -> torch.Tensor | None:
    """The int8 steps with ``scale == unit * steps``, group by group, where the codes carry them
    (GGUF k-quants: :class:`GroupCodes`) and their groups tile the units; else None."""
    if codes.unit is None or codes.steps is None:
        return None
    if codes.shape[1] % UNIT or UNIT % codes.group_size:
        return None
    return codes.steps


def _factored_4(codes: GroupCodes) -> bool:
    """Whether 4-bit codes carry a k-quant's scales and minimums as integers per group times
    float16 units per 256 columns (Q4_K), which :class:`VnniInt4Weight` keeps so: 4.625 bits a
    weight, against 5 with a float16 ``d`` and ``m`` per group of 32."""
    if _factored(codes) is None or codes.shift_steps is None or codes.shift_unit is None:
        return False
    return all(_exact_half(u) for u in (codes.unit, codes.shift_unit))


def _exact_half(c: torch.Tensor) -> bool:
    """Whether float16 holds every value of ``c`` exactly (a GGUF block's own d and m do; Q6_K's
    and the other k-quants' multiplied-out constants in general do not)."""
    h = c.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), c.float())


class VnniInt8GroupWeight(VnniWeight):
    """8-bit codes in groups (GGUF's Q8_0; 6-bit ones widened) in int8's VNNI tiles,
    ``w = d * (u - 128) + m`` per group: ``llmlib_vnni::int8g_linear``. Constants are float16
    where exact, else float32; a k-quant's scales stay factored (int8 ``d``, float32 ``u``)."""

    kind = "int8 group vnni"

    def __init__(self, codes: GroupCodes, dtype: torch.dtype) -> None:
        if codes.bits not in (6, 8):
            raise ValueError(f"{self.kind} holds 6- or 8-bit codes, got {codes.bits}-bit ones")
        super().__init__(codes.shape)
        self._store(eight_bit(codes), dtype)

    def _store(self, codes: GroupCodes, dtype: torch.dtype) -> None:
        self.group_size = codes.group_size
        self.register_buffer("act", torch.empty(0, dtype=dtype))
        self.register_buffer("w", self._pack(codes.q).contiguous())
        # GroupCodes' convention is (q - offset) * scale + zero: d = scale, m = zero
        d, m = codes.scale.float(), codes.zero.float()
        ints = _factored(codes)
        if ints is not None:
            const = torch.float32  # the offsets' dtype beside int8 integers
            self.register_buffer("d", tile_constants(ints).contiguous())
            self.register_buffer("u", tile_constants(codes.unit.float()).contiguous())
        else:
            const = torch.float16 if _exact_half(d) and _exact_half(m) else torch.float32
            self.register_buffer("d", tile_constants(d.to(const)).contiguous())
            self.register_buffer("u", torch.empty(0))
        # no offsets (Q8_0, Q6_K): none stored, and the kernel skips their multiply-adds
        offsets = (
            tile_constants(m.to(const)).contiguous() if m.any() else torch.empty(0, dtype=const)
        )
        self.register_buffer("m", offsets)
        self.refresh()

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return pack_uint8(q)

    def refresh(self) -> None:
        """Whether any group has an offset (again, after :class:`llmlib.kernels.stream.Filled`)."""
        self.has_offsets = bool(self.m.numel() and self.m.any())
        if not self.has_offsets:
            self.m = self.m.new_empty(0)

    @property
    def label(self) -> str:
        return f"int8 g{self.group_size} {_build_name()}"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmlib_vnni.int8g_linear(
            x, self.w, self.d, self.m, self.u, self.group_size
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return _group_rows(self, unpack_int8(self.w, self.shape[1], ids), ids)  # q: u - 128


class VnniInt6Weight(VnniInt8GroupWeight):
    """6-bit codes in groups (GGUF's Q6_K, Q5_x, Q3_K, Q2_K) in :func:`pack_int6`'s tiles, six
    bits a weight as the file holds Q6_K, with the constants of :class:`VnniInt8GroupWeight`:
    ``llmlib_vnni::int6_linear``."""

    kind = "int6 group vnni"

    def __init__(self, codes: GroupCodes, dtype: torch.dtype) -> None:
        if codes.bits != 6:
            raise ValueError(f"{self.kind} holds 6-bit codes, got {codes.bits}-bit ones")
        VnniWeight.__init__(self, codes.shape)
        self._store(codes, dtype)

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return pack_int6(q)

    @property
    def label(self) -> str:
        return f"int6 g{self.group_size} {_build_name()}"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmlib_vnni.int6_linear(x, self.w, self.d, self.m, self.u, self.group_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = unpack_int6(self.w, self.shape[1], ids).to(torch.int16) - 32  # q: c6 - 32
        return _group_rows(self, q, ids)


def pack(codes: ChannelCodes | GroupCodes, dtype: torch.dtype) -> PackedWeight | None:
    """``codes`` in this layout for ``dtype`` activations where it runs and fits; else None."""
    if not available():
        return None
    if isinstance(codes, ChannelCodes):
        return VnniInt8Weight(codes, dtype) if fits(codes.shape) else None
    if codes.bits == 4 and fits(codes.shape, codes.group_size):
        return VnniInt4Weight(codes, dtype)
    if codes.bits == 6 and fits(codes.shape, codes.group_size, bits=6):
        six = flags().six_bit and (codes.group_size == 16 or codes.group_size % BLOCK == 0)
        return VnniInt6Weight(codes, dtype) if six else VnniInt8GroupWeight(codes, dtype)
    if codes.bits == 8 and fits(codes.shape, codes.group_size, bits=8):
        return VnniInt8GroupWeight(codes, dtype)
    return None
