"""One rank's model: its slice of every tensor read from the checkpoint, and nothing else.

:func:`load_shard` opens the checkpoint lazily (:func:`llmlib.checkpoints.lazy.read_checkpoint_lazy`),
checks the *whole* model's tensors against the shape table before reading a byte, reads only
this rank's slices (:func:`llmlib.parallel.shard.shard_state`), and builds the rank's model with
the same :func:`llmlib.checkpoints.build.build_model` every model goes through (which checks the
slices against the rank's shape table). Slicing comes first, so whatever the build does to the
weights afterwards (a dtype, a CPU layout, a quantized format) it does to the slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmlib.checkpoints.build import build_model, check_state_dict
from llmlib.checkpoints.lazy import read_checkpoint_lazy
from llmlib.config import ModelConfig
from llmlib.model import Transformer
from llmlib.parallel.shard import check_engine_tp, shard_config, shard_state
from llmlib.shapes import numel, param_shapes


def load_shard(
    path: str | Path,
    tp: int,
    rank: int,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[Transformer, ModelConfig]:
    """``(rank's model, the full model's config)`` for rank ``rank`` of ``tp``.

    The returned model has :func:`~llmlib.parallel.shard.shard_config`'s shapes and no
    communication yet (:func:`llmlib.parallel.comm.parallelize` adds it).
    """
    cfg, lazy, name_of = read_checkpoint_lazy(path)
    try:
        check_engine_tp(cfg, tp)
        check_state_dict(cfg, lazy, name_of)
        state = shard_state(lazy, cfg, tp, rank)
        del lazy
        model = build_model(shard_config(cfg, tp), state, device, dtype, name_of=name_of)
    except ValueError as e:
        raise ValueError(f"{Path(path).name}: {e}") from None
    return model, cfg


def shard_model(model: Transformer, tp: int, rank: int) -> Transformer:
    """Rank ``rank``'s model cut from a whole one in memory (tests and the book)."""
    cfg = model.config
    state = shard_state(model.state_dict(), cfg, tp, rank)
    p = next(model.parameters())
    return build_model(shard_config(cfg, tp), state, p.device, p.dtype)


@dataclass(frozen=True)
class WeightBytes:
    """What one rank holds: the model's tensors, and how much of that the table says it should."""

    held: int  # bytes of the rank's model: its matrices as stored (one copy each), the rest
    expected: int  # the rank's shape table at the same element size
    replicated: int  # of which norms (and routers) every rank holds whole
    full: int  # the whole model's tensors at the same element size


def weight_bytes(model: nn.Module, cfg: ModelConfig, tp: int) -> WeightBytes:
    """Count a rank's resident weights against its shard and the whole model (same dtype)."""
    from llmlib.kernels.prepare import read_bytes, weight_matrices

    mats = weight_matrices(model)
    matrix_params = {id(m.weight) for m in mats.values()}
    params = [p for p in model.parameters() if id(p) not in matrix_params]
    elt = model.dtype.itemsize
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(read_bytes(m.weight) for m in mats.values())
    local = param_shapes(shard_config(cfg, tp))
    full = param_shapes(cfg)
    replicated = sum(numel(s) for k, s in local.items() if s == full[k] and tp > 1 and s != ())
    return WeightBytes(
        held=held,
        expected=sum(numel(s) for s in local.values()) * elt,
        replicated=replicated * elt,
        full=sum(numel(s) for s in full.values()) * elt,
    )
