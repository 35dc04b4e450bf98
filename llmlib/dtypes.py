"""Number formats by name: the one table of dtype names, their aliases and their sizes.

Users type ``bf16``, ``bfloat16`` or ``torch.bfloat16``; the cost model needs bytes per weight
for formats torch has no dtype for (GGUF's ``q4_1`` blocks); the loaders need a ``torch.dtype``.
This table answers all three, and it imports no torch (the cost model runs without it).

``bytes_per_element`` counts a block format's constants too: Q8_0 stores 32 weights in 34 bytes
(one float16 scale), Q4_0 in 18, Q4_1 in 20 (a scale and a minimum). ``int8``/``int4`` are ideal
packings; a real int4 layout adds its group scales on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NumberFormat:
    """One way of storing numbers: its canonical name, size, and whether activations can use it."""

    name: str
    bytes_per_element: float
    is_float: bool  # a float format holds activations and caches; the others are weight-only
    aliases: tuple[str, ...] = ()


FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        NumberFormat("float32", 4.0, True, ("fp32", "f32", "float")),
        NumberFormat("bfloat16", 2.0, True, ("bf16",)),
        NumberFormat("float16", 2.0, True, ("fp16", "f16", "half")),
        NumberFormat("fp8", 1.0, False),
        NumberFormat("int8", 1.0, False),
        NumberFormat("int4", 0.5, False),
        NumberFormat("q8_0", 34 / 32, False),
        NumberFormat("q4_0", 18 / 32, False),
        NumberFormat("q4_1", 20 / 32, False),
    )
}

_BY_ALIAS: dict[str, NumberFormat] = {
    key: f for f in FORMATS.values() for key in (f.name, *f.aliases)
}


def number_format(name: Any) -> NumberFormat:
    """The format a name (or a ``torch.dtype``) means; a ``ValueError`` lists the known names."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _BY_ALIAS:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_BY_ALIAS))}")
    return _BY_ALIAS[key]


def canonical(name: Any) -> str:
    """``"bf16"`` -> ``"bfloat16"``, ``torch.float32`` -> ``"float32"``."""
    return number_format(name).name


def bytes_per_element(name: Any) -> float:
    """Bytes one stored value takes (``bf16`` -> 2, ``q4_1`` -> 0.625, ...)."""
    return number_format(name).bytes_per_element


def is_float(name: Any) -> bool:
    """Whether activations and caches can be held in this format (not a weight-only one)."""
    return number_format(name).is_float


def torch_dtype(name: Any) -> Any:
    """The ``torch.dtype`` of a float format name (a ``torch.dtype`` passes through, checked)."""
    import torch

    if isinstance(name, torch.dtype):
        if not name.is_floating_point:
            raise ValueError(f"dtype: {name} is not a floating-point type")
        return name
    fmt = number_format(name)
    if not fmt.is_float:
        raise ValueError(f"dtype: {name!r} is a weight-only format, not a floating-point dtype")
    return getattr(torch, fmt.name)


#: The weight-only quantizations a loader accepts (:mod:`llmlib.quantize`).
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4", "gguf")


def int4_bytes_per_weight(group_size: int, constant_bytes: float = 2.0) -> float:
    """Bytes per weight of group-wise int4: half a byte, plus a scale and a zero point of
    ``constant_bytes`` each per ``group_size`` weights (g32 in bfloat16: 0.625, like Q4_1)."""
    return 0.5 + 2 * constant_bytes / group_size


#: Every name :func:`number_format` accepts, and those of the float formats.
NAMES: tuple[str, ...] = tuple(sorted(_BY_ALIAS))
FLOAT_NAMES: tuple[str, ...] = tuple(k for k in NAMES if _BY_ALIAS[k].is_float)
