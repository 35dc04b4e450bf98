"""Speed, swapped in once a model is built: each matrix in the layout its kernel reads.

The book's model (:mod:`llmlib.model`) is plain PyTorch. :func:`prepare` makes it fast here, the
way gpt-fast swaps in its quantized linears: once, for every weight matrix, it picks a layout
and kernel (:mod:`llmlib.kernels.weights`), stores the matrix so (straight from the checkpoint
when a loader streams it in), and puts a :class:`~llmlib.kernels.modules.PackedLinear` where
the ``nn.Linear`` was; norms become the fused kernel. The model never asks which CPU it runs on.

What decides (:func:`pack_matrix`), for a matrix on a CPU:

* int8/int4 codes (quantized here, or a GGUF file's blocks): integer dot products
  (:mod:`llmlib.kernels.integer`) where the flags choose them and the shape fits, else PyTorch's
  weight-only kernels (:class:`~llmlib.kernels.weights.Int8Weight`, ``Int4Weight``);
* float32: the one-row kernel and oneDNN's second copy where the flags choose them
  (:class:`~llmlib.kernels.weights.Float32Weight`), in one buffer (:mod:`llmlib.kernels.layout`);
* bfloat16: oneDNN's blocked layout where the CPU has one (:mod:`llmlib.kernels.onednn`), else
  widened to float32 for several rows (:class:`~llmlib.kernels.bfloat16.Bfloat16Weight`).

On a GPU, float matrices stay ``nn.Linear`` and codes take PyTorch's CUDA kernels. Every choice
comes from :func:`llmlib.kernels.flags.flags`, so a test can force each path.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmlib.dtypes import QUANTIZATIONS
from llmlib.kernels import integer, layout, matvec, onednn
from llmlib.kernels import norm as fused_norm
from llmlib.kernels.bfloat16 import Bfloat16Weight
from llmlib.kernels.flags import flags
from llmlib.kernels.modules import PackedEmbedding, PackedLinear
from llmlib.kernels.stacked import StackedWeight
from llmlib.kernels.stream import Rows, assemble, give_back_freed_memory
from llmlib.kernels.weights import (
    Float32Weight,
    Int4Weight,
    PackedWeight,
    RowTiles,
    pack_reference,
)
from llmlib.model.embedding import TokenEmbedding
from llmlib.model.norm import RMSNorm
from llmlib.quantize import (
    ChannelCodes,
    CodeParts,
    Codes,
    GroupCodes,
    quantize_int4,
    quantize_int8,
)

#: What a matrix is made from: a float tensor or codes, whole or read a slice of rows at a time.
Source = torch.Tensor | ChannelCodes | GroupCodes | CodeParts | Rows


@dataclass(frozen=True)
class Format:
    """How a model's weights are held: on ``device``, computing in ``dtype``, ``quantization``
    None, ``"int8"``, ``"int4"`` (``group_size`` weights per scale) or ``"gguf"`` (the file's
    blocks). ``plain``: float matrices and norms stay as the chapters build them."""

    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None
    group_size: int = 32
    plain: bool = False

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )

    @classmethod
    def of(cls, model: nn.Module) -> Format:
        """The format a model is in now (float weights, its device and dtype)."""
        return cls(torch.device(model.device), model.dtype)


def weight_matrices(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of every product weight a model multiplies by (name without ``.weight``):
    the fused projections, the output projections, the LM head (the embedding table when tied)."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear | PackedLinear):
            out[name] = mod
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.tie_embeddings:
        out["embed"] = model.embed
    return out


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    """Every matrix :func:`prepare` may store: the products' weights, and an untied embedding
    table (which a quantized file keeps in its codes, read row by row)."""
    out = weight_matrices(model)
    embed = getattr(model, "embed", None)
    if isinstance(embed, TokenEmbedding) and "embed" not in out:
        out["embed"] = embed
    return out


def quantize(name: str, w: torch.Tensor, fmt: Format, describe: Callable[[str], str]) -> Codes:
    """Codes for a float matrix in ``fmt.quantization``, rounded in slices (never whole in float32);
    int4 keeps the LM head (and a tied table) in int8, as llama.cpp does: every logit is from it."""
    rows = max(1, (64 << 20) // (4 * w.shape[1]))  # ~64 MiB of float32 at a time
    int8 = fmt.quantization == "int8" or name in ("embed", "lm_head")
    parts = []
    for i in range(0, w.shape[0], rows):
        chunk = w[i : i + rows].float()
        if int8:
            parts.append(quantize_int8(chunk))
        else:
            parts.append(quantize_int4(chunk, fmt.group_size, describe(f"{name}.weight")))
    return parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)


def pack_codes(codes: Codes, fmt: Format, *, rows: bool = False) -> PackedWeight | torch.Tensor:
    """Codes in the fastest layout here: the integer kernels', else PyTorch's (which has none for
    6- or 8-bit codes in groups: those become dense). ``rows``: also an embedding table, rows
    readable. A fused matrix whose parts are codes of different kinds keeps each part in its own
    layout where the integer kernels take them all, else becomes one matrix of the widest kind."""
    if isinstance(codes, CodeParts):
        parts = [pack_codes(p, fmt) for p in codes.parts] if fmt.device.type == "cpu" else []
        if parts and all(isinstance(p, integer.VnniWeight) for p in parts):
            return StackedWeight(parts)
        codes = codes.fused()
    if fmt.device.type == "cpu":
        packed = integer.pack(codes, fmt.dtype)
        if packed is not None:
            return packed
    if isinstance(codes, GroupCodes) and codes.bits != 4:
        return codes.dequantize().to(device=fmt.device, dtype=fmt.dtype)
    packed = pack_reference(codes, fmt.dtype, fmt.device)
    if rows and isinstance(packed, Int4Weight):
        packed.keep_codes_for_rows(codes)
    return packed


def pack_dense(name: str, w: torch.Tensor, fmt: Format) -> PackedWeight | torch.Tensor:
    """A float matrix in its fastest layout here (a plain tensor where PyTorch's product is)."""
    w = w.to(device=fmt.device, dtype=fmt.dtype)
    if fmt.device.type != "cpu" or fmt.plain:
        return w
    if fmt.dtype == torch.float32:
        one_row = w.shape[1] % 16 == 0 and w.is_contiguous() and matvec.available()
        blocked = onednn.available(torch.float32)
        return Float32Weight(w, one_row=one_row, blocked=blocked)
    if fmt.dtype != torch.bfloat16:
        return w
    if name != "embed" and onednn.available(torch.bfloat16):
        return onednn.OneDNNWeight(w)  # a table keeps plain rows for the lookup
    if flags().bfloat16_widen:
        return Bfloat16Weight(w)
    return w


def pack_matrix(
    name: str,
    src: Source,
    fmt: Format,
    describe: Callable[[str], str] = str,
    slot: torch.Tensor | None = None,
) -> PackedWeight | torch.Tensor:
    """The decision for one matrix: what it is made from, the format asked for, this machine.
    ``slot``: where a float32 CPU matrix is to live (:func:`llmlib.kernels.layout.slots`)."""
    if isinstance(src, Rows):
        here = fmt.quantization in ("int8", "int4")  # float rows rounded as they come
        rounding = functools.partial(quantize, fmt=fmt, describe=describe) if here else None
        src = assemble(src, name, fmt, rounding, slot)
    elif slot is not None and isinstance(src, torch.Tensor):
        src = slot.copy_(src)
    if isinstance(src, torch.Tensor) and fmt.quantization in ("int8", "int4"):
        src = quantize(name, src, fmt, describe)
    if isinstance(src, torch.Tensor):
        return pack_dense(name, src, fmt)
    if isinstance(src, PackedWeight):  # packed slice by slice already
        return src
    try:
        return pack_codes(src, fmt, rows=name == "embed")
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"{describe(f'{name}.weight')}: {fmt.quantization} weights cannot be packed here: {e}"
        ) from None


def prepare(
    model: nn.Module,
    fmt: Format | None = None,
    sources: Callable[[str], Source | None] | None = None,
    *,
    describe: Callable[[str], str] = str,
    progress: bool = False,
) -> nn.Module:
    """Store every matrix of ``model`` for this machine's kernels, in place; return the model.
    ``fmt`` defaults to the model's device and dtype, unquantized. ``sources(name)`` hands in a
    matrix by module name (``"layers.0.attn.wqkv"``) read from the checkpoint just then, so a
    loader streams the file through here one matrix at a time; None keeps the model's own
    weights. A matrix already stored is left alone. ``describe`` names a matrix for errors."""
    fmt = fmt or Format.of(model)
    tables = _tables(model)
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    # float32 matrices on a CPU go into one buffer: planned from the shapes, filled as they come
    dense32 = [
        n
        for n, m in tables.items()
        if fmt.device.type == "cpu"
        and fmt.dtype == torch.float32
        and fmt.quantization is None
        and not fmt.plain
        and isinstance(m.weight, torch.Tensor)
        and (n != "embed" or tied)
    ]
    slots = _slots(tables, dense32)
    todo = list(tables.items())
    if progress:
        from tqdm import tqdm  # plain tqdm: tqdm.auto warns in notebooks without ipywidgets

        todo = tqdm(todo, desc="loading", unit="matrix", leave=False)
    for name, mod in todo:
        if isinstance(mod.weight, PackedWeight):
            continue
        src = sources(name) if sources is not None else None
        if src is None:
            src = mod.weight.detach()
        if name == "embed" and not tied:
            if isinstance(src, Rows):  # a table read in slices: its float rows, not quantized
                src = assemble(src, name, fmt, None, None)
            if isinstance(src, torch.Tensor):
                _set_dense(mod, src, fmt)  # an untied float table: plain rows for the lookup
                continue
        packed = pack_matrix(name, src, fmt, describe, slots.get(name))
        del src
        size = 4 * mod.weight.numel()  # its float32 size: what its temporaries take
        _install(model, name, mod, packed)
        if fmt.device.type == "cpu":
            give_back_freed_memory(size)
    if fmt.device.type == "cpu":
        give_back_freed_memory()
    _fuse_norms(model, fmt)
    model.weight_format = format_name(model, fmt)
    return model


def _slots(tables: dict[str, nn.Module], names: list[str]) -> dict[str, torch.Tensor]:
    """Empty views of one buffer, one per float32 matrix, in the decode layout."""
    if not names:
        return {}
    shapes = [tuple(tables[n].weight.shape) for n in names]
    views = layout.slots(shapes, torch.float32, one_row_kernel=matvec.available())
    return dict(zip(names, views))


def _set_dense(mod: nn.Module, w: torch.Tensor, fmt: Format) -> None:
    w = w.detach().to(device=fmt.device, dtype=fmt.dtype)
    del mod.weight
    mod.weight = nn.Parameter(w, requires_grad=False)


def _install(model: nn.Module, name: str, mod: nn.Module, packed: PackedWeight | torch.Tensor):
    """Put the stored matrix where the layer was: a tensor as its weight, a layout as a layer."""
    if isinstance(packed, torch.Tensor):
        del mod.weight
        mod.weight = nn.Parameter(packed, requires_grad=False)
        return
    if isinstance(mod, TokenEmbedding):
        new: nn.Module = PackedEmbedding(packed, mod.scale)
    else:
        bias = getattr(mod, "bias", None)
        new = PackedLinear(packed, None if bias is None else bias.detach())
    replace_module(model, name, new)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` of ``model`` was."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _fuse_norms(model: nn.Module, fmt: Format) -> None:
    if fmt.device.type != "cpu" or fmt.plain or not fused_norm.available():
        return
    for name, mod in list(model.named_modules()):
        if type(mod) is RMSNorm and not mod.offset:
            replace_module(model, name, fused_norm.FusedRMSNorm.replacing(mod))


def format_name(model: nn.Module, fmt: Format | None = None) -> str:
    """What the weights are held in: ``float32``, ``gguf (int4 g32 vnni x210, int8 vnni x1) /
    bfloat16`` (``avx2`` in place of ``vnni`` where that build of the integer kernels runs)."""
    fmt = fmt or Format.of(model)
    dtype = str(fmt.dtype).removeprefix("torch.")
    if fmt.quantization is None:
        return dtype
    kinds: Counter[str] = Counter()
    for mod in weight_matrices(model).values():
        w = mod.weight
        kinds[w.label if isinstance(w, PackedWeight) else str(w.dtype).removeprefix("torch.")] += 1
    inner = ", ".join(f"{k} x{n}" for k, n in kinds.most_common())
    return f"{fmt.quantization} ({inner}) / {dtype}"


def quantize_model(
    model: nn.Module,
    quantization: str,
    *,
    group_size: int = 32,
    codes: dict[str, Codes] | None = None,
    describe: Callable[[str], str] = str,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """A loaded float model's matrices re-stored as ``quantization`` (``"int8"``, ``"int4"``, or
    ``"gguf"`` with ``codes`` by module name), in place (:func:`prepare`); return ``model``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}"
        )
    fmt = Format(torch.device(model.device), dtype or model.dtype, quantization, group_size)
    sources = None if codes is None else codes.get
    prepare(model, fmt, sources, describe=describe)
    for p in model.parameters():  # the norms and any matrix left dense
        p.data = p.data.to(fmt.dtype)
    return model


#: the row counts a batch-invariant product's last tile may be padded to (:func:`row_tiled`)
TAILS = (2, 4, 8, 16, 32)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules sharing every tensor, plain attributes too (Float32Weight's
    opaque oneDNN copy has no storage for deepcopy): swapping its modules leaves the model alone."""
    held = (v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))
    tensors = itertools.chain(model.parameters(), model.buffers(), held)
    return copy.deepcopy(model, memo={id(t): t for t in tensors})


def row_tiled(
    model: nn.Module, tile: int, larger: tuple[int, ...] = (), tails: tuple[int, ...] = TAILS
) -> nn.Module:
    """A view of ``model`` (tensors shared) whose every product is taken ``tile`` rows at a time
    (:class:`~llmlib.kernels.weights.RowTiles`): what the batch-invariant engine runs. MKL's
    float32 kernels for AVX2 compute rows 30 and 31 of 32 with other code, so below AVX-512
    float32 matrices get oneDNN's blocked copy (every row alike) and bfloat16 ones are multiplied
    plainly. Each kind of matrix is checked once (:meth:`RowTiles.alike`): ``tile``, else the
    first of ``larger`` that passes, else an error; then the ``tails`` that give a row the
    tile's bits may hold a last, partial tile."""
    view = shared_copy(model)
    chosen: dict[tuple, tuple[int, tuple[int, ...]] | None] = {}
    for name, mod in weight_matrices(view).items():
        w = mod.weight
        if isinstance(w, Bfloat16Weight):  # its widened product is not row-invariant: see there
            w = w.dequantize()
        elif isinstance(w, Float32Weight) and w.blocked is None and flags().isa != "avx512":
            w = Float32Weight(w.w, one_row=w.one_row, blocked=onednn.supported(torch.float32))
        inner = w if isinstance(w, PackedWeight) else w.detach()
        key = (type(inner), getattr(inner, "kind", ""), inner.dtype, tuple(inner.shape))
        if key not in chosen:  # one check per kind of matrix: the same kernel for each
            t = next((t for t in (tile, *larger) if RowTiles(inner, t).alike()), None)
            alike = [] if t is None else [s for s in tails if s < t and RowTiles(inner, t).alike(s)]
            chosen[key] = None if t is None else (t, tuple(alike))
        if chosen[key] is None:
            raise ValueError(
                f"batch-invariant view: no tile of {(tile, *larger)} rows multiplies {name} "
                f"({key[1] or key[2]}, {key[3]}) with every row alike on this CPU"
            )
        tiles = RowTiles(inner, *chosen[key])
        if isinstance(mod, TokenEmbedding):
            replace_module(view, name, PackedEmbedding(tiles, mod.scale))
        else:
            bias = getattr(mod, "bias", None)
            replace_module(view, name, PackedLinear(tiles, None if bias is None else bias.detach()))
    return view


def read_bytes(w: PackedWeight | torch.Tensor) -> int:
    """Bytes one product reads from a stored matrix (a oneDNN second copy not counted)."""
    if isinstance(w, Float32Weight):
        return w.w.numel() * 4
    if isinstance(w, PackedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def blocked_copies(model: nn.Module, on: bool) -> int:
    """Give every float32 matrix a oneDNN-blocked second copy (``on``) or drop them; how many
    changed. ``llmlib bench batching`` times both ways, in one run."""
    n = 0
    for mod in weight_matrices(model).values():
        w = mod.weight
        if isinstance(w, Float32Weight) and (w.blocked is not None) != on:
            w.blocked = (
                torch.ops.mkldnn._reorder_linear_weight(w.w.contiguous(), None) if on else None
            )
            n += 1
    return n
