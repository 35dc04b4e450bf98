"""How a model splits over ``tp`` ranks (Megatron-LM's tensor parallelism), tensor by tensor.

Every rank runs the whole network on the whole batch, but holds only a slice of each weight
matrix, chosen so that a layer needs one all-reduce per sub-layer and nothing else:

==========================================  ==================================  ==========================
tensor (llmlib name)                        rank ``r`` of ``N`` holds           why
==========================================  ==================================  ==========================
``attn.wq`` (and its bias)                  rows of query heads                 column-parallel: a head's
                                            ``r H/N .. (r+1) H/N - 1``          attention needs only its
                                                                                own q, k, v
``attn.wk``, ``attn.wv`` (and biases)       rows of the KV heads those query    whole GQA groups, so no
                                            heads read (replicated when         rank reads another's keys
                                            ``N > Hkv``)
``attn.wo``                                 the same heads' columns             row-parallel: partial sums,
                                                                                all-reduced
``attn.wo.bias``                            all of it on rank 0, zeros          the all-reduce adds it
                                            elsewhere                           exactly once
``ffn.w_gate``, ``ffn.w_up`` (each expert)  rows ``r F/N .. (r+1) F/N - 1``     column-parallel
``ffn.w_down`` (each expert)                the same columns                    row-parallel, all-reduced
``embed``, ``lm_head``                      vocabulary rows ``r V'/N ..``,      vocabulary-parallel;
                                            ``V' = N ceil(V/N)`` (zero rows     logits gathered at the end
                                            pad the last rank)
norms, ``q_norm``/``k_norm``, ``router``    all of it                           small; every rank must
                                                                                route tokens alike
==========================================  ==================================  ==========================

A mixture of experts is split **by the expert matrices**, not by experts: each expert's gate and
up rows and down columns are cut like a dense FFN's. Under tensor parallelism every rank already
sees every token (the activations are replicated after each all-reduce), so cutting each expert
keeps every rank's work equal whatever the router picks, and costs no communication beyond the
one all-reduce the FFN has anyway. Splitting by experts (expert parallelism) would put a whole
expert on one rank, leave ranks idle or overloaded as routing skews, and need an all-to-all to
send tokens to their experts and back: a win for many experts over many GPUs with data
parallelism, not a drop-in replacement for the FFN's all-reduce.

A rank's shapes are those of :func:`shard_config` in the one shape table
(:func:`llmlib.shapes.param_shapes`); :func:`shard_specs` says where each slice comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from llmlib.analysis.capacity import check_tp, kv_heads_per_gpu
from llmlib.config import ModelConfig
from llmlib.shapes import param_shapes

#: How a rank's tensor comes from the full one.
ROWS, COLS, WHOLE, FIRST_RANK = "rows", "cols", "whole", "first_rank"


def check_engine_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse, with the reason, a split the engine cannot run; the same rules as the cost model
    (:func:`llmlib.analysis.capacity.check_tp`: whole query heads per rank, KV heads split or replicated)
    plus whole FFN and expert columns."""
    check_tp(cfg, tp)
    if cfg.ffn_dim % tp:
        raise ValueError(
            f"{cfg.name}: an FFN width of {cfg.ffn_dim} does not split over {tp} ranks"
        )
    if cfg.n_experts and cfg.expert_dim % tp:
        raise ValueError(
            f"{cfg.name}: an expert width of {cfg.expert_dim} does not split over {tp} ranks"
        )


def vocab_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary rows each rank holds: ``ceil(V / tp)`` (the last rank's tail is zero padding)."""
    return -(-cfg.vocab_size // tp)


def vocab_range(cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int]:
    """The token ids ``[start, stop)`` whose embedding rows and logits live on ``rank``."""
    n = vocab_per_rank(cfg, tp)
    return min(rank * n, cfg.vocab_size), min((rank + 1) * n, cfg.vocab_size)


def kv_head_start(cfg: ModelConfig, tp: int, rank: int) -> int:
    """The first KV head ``rank`` holds: its query heads' group (``r Hkv / tp``, rounded down)."""
    return rank * cfg.n_kv_heads // tp


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape one rank's model has: ``1/tp`` of the heads, FFN width and vocabulary."""
    check_engine_tp(cfg, tp)
    if tp == 1:
        return cfg
    return cfg.replace(
        name=f"{cfg.name} [rank of {tp}]",
        n_heads=cfg.n_heads // tp,
        n_kv_heads=kv_heads_per_gpu(cfg, tp),
        head_dim=cfg.head_dim,  # explicit: d_model // local heads would be wrong
        ffn_dim=cfg.ffn_dim // tp,
        expert_ffn_dim=cfg.expert_ffn_dim // tp,
        vocab_size=vocab_per_rank(cfg, tp),
    )


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's tensor comes from: ``full[start:stop]`` along ``dim`` (``ROWS``/``COLS``),
    the whole tensor (``WHOLE``), or the whole on rank 0 and zeros elsewhere (``FIRST_RANK``).
    ``shape`` is the rank's shape (from :func:`shard_config`'s shape table)."""

    kind: str
    shape: tuple[int, ...]
    start: int = 0
    stop: int = 0

    @property
    def dim(self) -> int:
        return 1 if self.kind == COLS else 0


_HEAD_ROWS = re.compile(r"attn\.(wq|wk|wv)\.(weight|bias)$")
_FFN = re.compile(r"ffn\.(?:experts\.\d+\.)?(w_gate|w_up|w_down)\.weight$")


def shard_specs(cfg: ModelConfig, tp: int, rank: int) -> dict[str, ShardSpec]:
    """Every tensor of ``cfg``'s model, as rank ``rank`` of ``tp`` holds it."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in 0..{tp - 1}, got {rank}")
    local = param_shapes(shard_config(cfg, tp))
    hd = cfg.head_dim
    q0 = rank * (cfg.n_heads // tp) * hd
    k0 = kv_head_start(cfg, tp, rank) * hd
    specs: dict[str, ShardSpec] = {}
    for name, full in param_shapes(cfg).items():
        shape = local[name]
        if tp == 1 or (shape == full and not name.endswith("attn.wo.bias")):
            specs[name] = ShardSpec(WHOLE, shape)
        elif m := _HEAD_ROWS.search(name):
            a = q0 if m.group(1) == "wq" else k0
            specs[name] = ShardSpec(ROWS, shape, a, a + shape[0])
        elif name.endswith("attn.wo.weight"):
            specs[name] = ShardSpec(COLS, shape, q0, q0 + shape[1])
        elif name.endswith("attn.wo.bias"):
            specs[name] = ShardSpec(FIRST_RANK, shape)
        elif m := _FFN.search(name):
            n = shape[1] if m.group(1) == "w_down" else shape[0]
            kind = COLS if m.group(1) == "w_down" else ROWS
            specs[name] = ShardSpec(kind, shape, rank * n, (rank + 1) * n)
        elif name in ("embed.weight", "lm_head.weight"):
            specs[name] = ShardSpec(ROWS, shape, *vocab_range(cfg, tp, rank))
        else:
            raise ValueError(f"no tensor-parallel rule for {name!r} of shape {full}")
    return specs


def take(t: Any, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` (a tensor, or a :class:`~llmlib.checkpoints.lazy.LazyTensor`,
    of which only that part is read)."""
    from llmlib.checkpoints.lazy import materialize

    if spec.kind == WHOLE:
        return materialize(t)
    if spec.kind == FIRST_RANK:
        return materialize(t) if rank == 0 else torch.zeros(spec.shape, dtype=t.dtype)
    part = materialize(t.narrow(spec.dim, spec.start, spec.stop - spec.start))
    short = spec.shape[spec.dim] - part.shape[spec.dim]
    if short > 0:  # the vocabulary's padding rows on the last rank(s)
        pad = torch.zeros((short, *part.shape[1:]), dtype=part.dtype)
        part = torch.cat([part, pad], dim=0)
    if tuple(part.shape) != spec.shape:
        raise ValueError(f"a shard of shape {tuple(part.shape)} where {spec.shape} was expected")
    return part


def shard_state(state: dict[str, Any], cfg: ModelConfig, tp: int, rank: int) -> dict:
    """Rank ``rank``'s state dict, from the full one (tensors or lazy tensors)."""
    return {k: take(state[k], spec, rank) for k, spec in shard_specs(cfg, tp, rank).items()}
