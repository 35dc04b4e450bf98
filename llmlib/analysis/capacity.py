"""Memory capacity and communication: what fits on how many GPUs, and what splitting a model costs.

A model whose weights outgrow one GPU is split over several with tensor parallelism (Megatron's
scheme): every weight matrix is cut into ``tp`` slices, one per
GPU, so each GPU holds and reads ``1 / tp`` of the weights and the bandwidths add up. The price is
communication: after each row-parallel product (attention's output projection and the FFN's
down projection) the partial sums of every GPU are added together with an all-reduce, two per
layer, each of one activation vector per token.

This module is arithmetic on a :class:`~llmlib.config.ModelConfig` and a GPU's datasheet
(:mod:`llmlib.analysis.gpus`), like :mod:`llmlib.analysis.costs`, with three stated conventions:

* **Runtime reserve.** Of each GPU's memory, :data:`RUNTIME_RESERVE` (10%, vLLM's default
  ``gpu_memory_utilization`` of 0.9) is held back for activations, the CUDA context and
  fragmentation. Weights plus KV cache must fit in the rest.
* **What is split.** Query heads, KV heads, the FFN width, the vocabulary (embedding and LM head)
  are divided by ``tp``; norms are replicated. With more GPUs than KV heads each KV head is
  replicated on ``tp / n_kv_heads`` GPUs (so every GPU still holds one).
* **The all-reduce.** A ring all-reduce of ``S`` bytes over ``n`` GPUs sends and receives
  ``2 (n - 1) / n * S`` bytes per GPU, at the link's bandwidth each way (NVLink where the GPU has
  it). That is a lower bound, like every floor here; NCCL adds a per-call latency of microseconds
  on top, which ``allreduce_latency_s`` can include.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from llmlib.analysis import costs as C
from llmlib.analysis.gpus import GPU, get_gpu
from llmlib.config import ModelConfig, get_config
from llmlib.shapes import kv_cache_bytes

#: Share of each GPU's memory held back from weights and KV cache (vLLM's default: 0.9 usable).
RUNTIME_RESERVE = 0.10


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError unless ``cfg`` splits evenly over ``tp`` GPUs (whole heads per GPU)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if cfg.n_heads % tp:
        raise ValueError(f"{cfg.name}: {cfg.n_heads} query heads do not split over {tp} GPUs")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(
            f"{cfg.name}: {cfg.n_kv_heads} KV heads neither split over {tp} GPUs nor replicate onto them"
        )


def kv_heads_per_gpu(cfg: ModelConfig, tp: int) -> int:
    """KV heads each GPU holds: ``n_kv_heads / tp``, or 1 (replicated) with more GPUs than heads."""
    return max(1, cfg.n_kv_heads // tp)


def weight_bytes_per_gpu(cfg: ModelConfig | str, tp: int = 1, dtype: str = "bf16") -> float:
    """Bytes of weights one GPU holds: every matrix and the vocabulary split ``tp`` ways, norms whole.

    With more GPUs than KV heads, the K and V projections are replicated like the heads they make.
    """
    cfg = get_config(cfg)
    check_tp(cfg, tp)
    p = C.param_counts(cfg)
    b = C.bytes_per_param(dtype)
    kv_share = kv_heads_per_gpu(cfg, tp) / cfg.n_kv_heads
    per_layer = (p.attn_q + p.attn_o + p.ffn_gate + p.ffn_up + p.ffn_down + p.router) / tp
    per_layer += (p.attn_k + p.attn_v) * kv_share
    vocab = (p.embedding + p.lm_head) / tp
    norms = p.final_norm + cfg.n_layers * p.norms_per_layer
    return (cfg.n_layers * per_layer + vocab) * b + norms * C._norm_bytes_per_param(dtype)


def kv_bytes_per_token_per_gpu(
    cfg: ModelConfig | str, tp: int = 1, kv_dtype: str = "bf16"
) -> float:
    """KV-cache bytes one token costs on each GPU (its share of the KV heads)."""
    cfg = get_config(cfg)
    check_tp(cfg, tp)
    return kv_cache_bytes(
        cfg.n_layers, kv_heads_per_gpu(cfg, tp), cfg.head_dim, 1, C.bytes_per_param(kv_dtype)
    )


def allreduce_bytes_per_token(
    cfg: ModelConfig | str, act_dtype: str = "bf16"
) -> tuple[float, float]:
    """``(per layer, whole model)``: bytes all-reduced per token, two activation vectors a layer."""
    cfg = get_config(cfg)
    per_layer = 2 * cfg.d_model * C.bytes_per_param(act_dtype)
    return per_layer, cfg.n_layers * per_layer


def allreduce_seconds(nbytes: float, tp: int, gpu: GPU | str, latency_s: float = 0.0) -> float:
    """A ring all-reduce of ``nbytes`` over ``tp`` GPUs: ``2 (tp - 1) / tp * nbytes`` at the link rate."""
    if tp == 1:
        return 0.0
    g = get_gpu(gpu)
    if g.link_bandwidth <= 0:
        raise ValueError(f"{g.name}: no GPU-to-GPU link bandwidth in llmlib.analysis.gpus")
    return 2 * (tp - 1) / tp * nbytes / g.link_bandwidth + latency_s


@dataclass(frozen=True)
class Sharding:
    """One model on ``tp`` GPUs of one kind: memory, capacity, communication and the decode floor."""

    model: str
    gpu: str
    tp: int
    dtype: str
    kv_dtype: str
    context: int
    gpu_memory_bytes: float
    reserve_bytes: float
    weight_bytes_per_gpu: float
    fits: bool  # the weights fit beside the reserve
    kv_bytes_per_token_per_gpu: float
    kv_tokens_capacity: int  # tokens of KV cache the memory left after weights holds (0 if none)
    max_batch_at_context: int  # sequences of ``context`` tokens that capacity holds
    allreduce_bytes_per_token_per_layer: float
    allreduce_bytes_per_token: float
    batch: int
    weight_read_ms: float  # one decode step's weights per GPU at the memory bandwidth
    kv_read_ms: float  # the batch's KV cache at ``context`` per GPU
    allreduce_ms: float  # the step's 2 x layers all-reduces of ``batch`` tokens
    decode_ms_per_step: float  # the three in sequence: the floor of one step for the whole batch
    comm_share: float  # fraction of the step spent in all-reduce
    compute_ms: float  # the step's FLOPs per GPU at the GPU's dense bf16 rate
    step_ms: float  # max(weights + KV, compute) + all-reduce: the step's roofline when split
    tokens_per_s: float  # batch / step_ms
    bound: str  # the largest of the three terms: "memory", "compute" or "communication"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def shard(
    model: ModelConfig | str,
    gpu: GPU | str = "h100-sxm",
    tp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    context: int = 8192,
    batch: int = 1,
    allreduce_latency_s: float = 0.0,
) -> Sharding:
    """Split ``model`` over ``tp`` GPUs: does it fit, how much KV cache is left, what a step costs.

    The decode floor of one step at ``batch`` sequences of ``context`` tokens each reads this GPU's
    weights and its share of the batch's KV cache at the memory bandwidth, then spends two
    all-reduces per layer on the batch's activations; the three are added (no overlap assumed).
    ``step_ms`` is the same step with the roofline's compute ceiling too: the larger of the
    memory time and the FLOPs time, plus the all-reduces, and ``bound`` names the largest term.
    """
    cfg = get_config(model)
    g = get_gpu(gpu)
    check_tp(cfg, tp)
    for name, v in (("context", context), ("batch", batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    kv_dtype = kv_dtype or C._default_kv_dtype(dtype)
    mem = g.memory_gb * 1e9
    reserve = RUNTIME_RESERVE * mem
    w = weight_bytes_per_gpu(cfg, tp, dtype)
    kv_tok = kv_bytes_per_token_per_gpu(cfg, tp, kv_dtype)
    free = mem - reserve - w
    capacity = max(0, math.floor(free / kv_tok)) if free > 0 else 0
    per_layer, total = allreduce_bytes_per_token(cfg, kv_dtype)
    t_w = w / g.bandwidth
    t_kv = batch * context * kv_tok / g.bandwidth
    t_ar = 2 * cfg.n_layers * allreduce_seconds(batch * per_layer / 2, tp, g, allreduce_latency_s)
    step = t_w + t_kv + t_ar
    # every GPU does 1/tp of each token's FLOPs (the attention of its own heads included)
    t_c = batch * C.flops_per_token(cfg, context + 1) / tp / g.flops
    roof = max(t_w + t_kv, t_c) + t_ar
    terms = {"memory": t_w + t_kv, "compute": t_c, "communication": t_ar}
    return Sharding(
        model=cfg.name,
        gpu=g.name,
        tp=tp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context=context,
        gpu_memory_bytes=mem,
        reserve_bytes=reserve,
        weight_bytes_per_gpu=w,
        fits=free > 0,
        kv_bytes_per_token_per_gpu=kv_tok,
        kv_tokens_capacity=capacity,
        max_batch_at_context=capacity // context,
        allreduce_bytes_per_token_per_layer=per_layer,
        allreduce_bytes_per_token=total,
        batch=batch,
        weight_read_ms=t_w * 1e3,
        kv_read_ms=t_kv * 1e3,
        allreduce_ms=t_ar * 1e3,
        decode_ms_per_step=step * 1e3,
        comm_share=t_ar / step,
        compute_ms=t_c * 1e3,
        step_ms=roof * 1e3,
        tokens_per_s=batch / roof,
        bound=max(terms, key=terms.get),
    )


def comm_over_weights_batch(
    model: ModelConfig | str, gpu: GPU | str, tp: int, dtype: str = "bf16", max_batch: int = 1 << 20
) -> int | None:
    """The smallest batch (short contexts) whose all-reduces take longer than reading this GPU's
    weights: past it, the link rather than the weights sets the memory floor. None within
    ``max_batch`` (or ``tp == 1``, which has no all-reduce)."""
    if tp == 1:
        return None
    one = shard(model, gpu, tp, dtype, context=1, batch=1)
    per_seq = one.allreduce_ms
    b = math.floor(one.weight_read_ms / per_seq) + 1
    return b if b <= max_batch else None


def min_gpus(
    model: ModelConfig | str, gpu: GPU | str, dtype: str = "bf16", max_tp: int = 64
) -> int:
    """The fewest GPUs (a valid ``tp``) whose memory holds the weights beside the reserve."""
    cfg = get_config(model)
    for tp in range(1, max_tp + 1):
        try:
            if shard(cfg, gpu, tp, dtype).fits:
                return tp
        except ValueError:
            continue  # this tp does not split the heads evenly
    raise ValueError(
        f"{cfg.name} does not fit on {max_tp} or fewer {get_gpu(gpu).name}s in {dtype}"
    )
