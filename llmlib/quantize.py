"""Weight-only quantization: fewer bytes per weight, multiplied as stored.

Decoding one token reads every weight once (chapter 9), so the bytes per weight set the floor.
Weight-only quantization stores each matrix as small integers plus a few float constants and
leaves the activations in a float format; a kernel made for the layout reads the integers and
scales them on the fly, inside the product, so the float matrix never exists in memory.

Two ways to round a float matrix to codes:

* :func:`quantize_int8` — one int8 per weight and one scale per output channel (row):
  ``w[n, k] = scale[n] * q[n, k]``, ``q`` in -127..127 (symmetric: ``scale = max|w[n]| / 127``).
* :func:`quantize_int4` — one 4-bit code per weight, and a scale and a zero point per *group* of
  ``group_size`` consecutive weights of a row: ``w = (q - 8) * scale + zero``, ``q`` in 0..15.
  Asymmetric (min to max of the group), so a group whose weights are all positive wastes no
  codes.

The codes are :class:`ChannelCodes` and :class:`GroupCodes`: plain tensors, row by row, so fused
matrices (q/k/v, gate/up) are the row-wise concatenation of their parts, and a GGUF file's own
blocks can be turned into codes without re-quantizing (:mod:`llmlib.checkpoints.repack`). How
codes are then stored for a kernel, and which kernel multiplies them on this machine, is the
machine's business: :mod:`llmlib.kernels.weights` and :func:`llmlib.kernels.prepare.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)


# ---- codes: what a quantizer produces, row by row, before any kernel's layout -------------------


@dataclass
class ChannelCodes:
    """int8 codes ``q [N, K]`` and one float32 scale per row: ``w = scale[:, None] * q``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @staticmethod
    def cat(parts: list[ChannelCodes]) -> ChannelCodes:
        return ChannelCodes(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class GroupCodes:
    """Codes ``q [N, K]`` (uint8, ``0 .. 2**bits - 1``) and per-group float32 ``scale``/``zero``
    ``[N, K/g]``: ``w[n, k] = (q[n, k] - 2**(bits-1)) * scale[n, k // g] + zero[n, k // g]``.

    ``bits=4`` is the int4 layout (``q - 8``); ``bits=6`` (``q - 32``) and ``bits=8``
    (``q - 128``) hold codes with a scale and an offset per group, which is what a GGUF file's
    other block types are once their constants are multiplied out
    (:mod:`llmlib.checkpoints.repack`): Q8_0 in eight bits, the rest in six.

    ``unit`` and ``steps`` (optional, together) say how the scales were made: a GGUF k-quant
    block of 256 weights has one float16 ``d`` (``unit``, float32 ``[N, K/256]``) and a small
    integer per group (``steps``, int8 ``[N, K/group]``), and its scales are their products,
    ``scale = unit * steps``, exactly. A kernel can then keep the steps in a byte and the units
    apart instead of a float32 per group (products of two float16 numbers' worth of bits do not
    fit a float16).

    ``shift_unit`` and ``shift_steps`` (optional, together) do the same for a k-quant's
    minimums (Q4_K, Q5_K, Q2_K): ``-dmin`` per 256 weights times an integer per group. Their
    product is the offset ``m`` of ``w = scale * (q - offset) + m`` with the codes counted from
    the file's own lowest value: ``zero - 8 * scale`` for 4-bit codes, ``zero`` for others."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int = 4
    unit: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    shift_unit: torch.Tensor | None = None
    shift_steps: torch.Tensor | None = None

    #: weights per ``unit``: a k-quant super-block
    UNIT = 256

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def offset(self) -> int:
        """What a code's value is measured from: 8 for 4-bit codes, 32 for 6-bit, 128 for 8-bit."""
        return 1 << (self.bits - 1)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().sub_(self.offset).view(n, k // self.group_size, self.group_size)
        return w.mul_(self.scale[..., None]).add_(self.zero[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        kinds = {(p.group_size, p.bits) for p in parts}
        if len(kinds) != 1:
            raise ValueError(
                f"cannot fuse matrices with different (group size, bits) {sorted(kinds)}"
            )
        g, bits = kinds.pop()
        factored = all(p.unit is not None and p.steps is not None for p in parts)
        shifts = factored and all(p.shift_steps is not None for p in parts)

        def cat(name: str, keep: bool) -> torch.Tensor | None:
            return torch.cat([getattr(p, name) for p in parts]) if keep else None

        return GroupCodes(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            g,
            bits,
            cat("unit", factored),
            cat("steps", factored),
            cat("shift_unit", shifts),
            cat("shift_steps", shifts),
        )

    def widened(self, bits: int, group_size: int) -> GroupCodes:
        """The same weights as codes of ``bits`` bits in groups of ``group_size``, exactly: codes
        move by the difference of the offsets, scales and zeros repeat over the smaller groups."""
        if bits < self.bits or self.group_size % group_size:
            raise ValueError(
                f"cannot hold {self.bits}-bit codes in groups of {self.group_size} as {bits}-bit "
                f"codes in groups of {group_size}"
            )
        q, scale, zero, steps = self.q, self.scale, self.zero, self.steps
        if bits != self.bits:
            q = q + ((1 << (bits - 1)) - self.offset)  # 4 -> 6 bits: + 24: c - 8 = (c + 24) - 32
        r = self.group_size // group_size

        def per_group(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or r == 1 else t.repeat_interleave(r, dim=1)

        # the minimums stay factored only where the offset they make does not change: 4-bit
        # codes widened count from another value, and their zero takes the difference in
        keep = bits == self.bits
        return GroupCodes(
            q,
            per_group(scale),
            per_group(zero),
            group_size,
            bits,
            self.unit,
            per_group(steps),
            self.shift_unit if keep else None,
            per_group(self.shift_steps) if keep else None,
        )


@dataclass(frozen=True)
class CodeParts:
    """A fused matrix (q/k/v, gate/up) whose row blocks a file stores in different kinds of codes
    (a Q4_K_M layer: q and k in Q4_K, v in Q6_K). Each part keeps its own codes, so a kernel reads
    each in its own bytes; :meth:`fused` is the one matrix of the widest kind, exactly."""

    parts: tuple[GroupCodes, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def fused(self) -> GroupCodes:
        """The parts in their widest common kind (the most bits, the smallest group)."""
        bits = max(p.bits for p in self.parts)
        group = min(p.group_size for p in self.parts)
        return GroupCodes.cat([p.widened(bits, group) for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Codes = ChannelCodes | GroupCodes | CodeParts


def quantize_int8(w: torch.Tensor) -> ChannelCodes:
    """Symmetric int8 per output channel: ``scale = max|w[n]| / 127``, ``q = round(w / scale)``."""
    w = w.detach().float()
    top = torch.maximum(w.amax(dim=1), -w.amin(dim=1))  # max|w|, without a copy of |w|
    scale = top.clamp_(min=1e-12) / 127.0
    steps = w / scale[:, None]  # one float32 temporary, rounded and clamped in place
    q = steps.round_().clamp_(-127, 127).to(torch.int8)
    return ChannelCodes(q, scale)


def quantize_int4(w: torch.Tensor, group_size: int = 32, name: str = "weight") -> GroupCodes:
    """Asymmetric int4 in groups of ``group_size`` along each row: the group's minimum to its
    maximum in 15 steps. Returns codes in the kernels' convention ``(q - 8) * scale + zero``."""
    check_group_size(group_size, w.shape[1], name)
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return GroupCodes(q.view(n, k), scale, lo + 8 * scale, group_size)


def check_group_size(group_size: int, in_features: int, name: str) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{name}: int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
    if in_features % group_size:
        raise ValueError(
            f"{name}: int4 group size {group_size} does not divide its {in_features} input "
            f"columns; choose one of "
            f"{[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none (keep int8)'}"
        )
