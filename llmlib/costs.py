"""The cost model: what a model configuration costs in parameters, bytes, FLOPs and seconds.

Everything here is arithmetic on a :class:`~llmlib.config.ModelConfig`; nothing is measured and
no figure is typed in. The book's chapter 1 uses it to reproduce the Llama-3-70B numbers
(bytes per layer, KV cache per token, the decode floor on an H100) and chapter 9 builds its
roofline on the same counts, so there is exactly one place where parameters are counted.

Conventions (the choices that decide the numbers, stated once):

* **Weights read per forward pass.** Every layer's matrices and norms, the final norm and the LM
  head are read once per pass, whether the pass carries one token (decode) or a whole prompt
  (prefill). The embedding table is *not* read in full: a lookup copies one row per token.
  With tied embeddings the LM head *is* the embedding table: it adds no parameters, but it is
  still read in full at every step, because every logit needs every row.
* **The article's 137 GB.** The source article quotes "137 GB per decode step" for Llama-3-70B,
  which is the 80 layers alone (80 x 1.712 GB). A decode step must also read the 2.1 GB LM head
  to produce logits, so this model says 139 GB and 41.5 ms on an H100 (the article: 41 ms). The
  difference is 1.5%, and it is the honest count.
* **Prefill and decode.** Prefill is one pass over the prompt and yields the first output
  token; each further output token costs one decode step. So ``output_tokens`` tokens cost
  ``1 + (output_tokens - 1)`` weight reads, and the final cache holds ``prompt + output`` positions.
* **FLOPs.** A matmul with a weight of ``n`` parameters costs ``2 n`` FLOPs per token (one multiply
  and one add per weight). Attention adds ``4 * n_heads * head_dim * S`` FLOPs per token per layer
  for a context of ``S`` positions (``Q K^T`` and ``P V``, each ``2 * H * hd * S``). Norms, RoPE,
  softmax and SiLU are ignored: they are a rounding error next to the matmuls.
* **Quantized dtypes.** ``int8``/``int4`` are ideal packings; ``q8_0``/``q4_0``/``q4_1`` are the
  GGUF block formats with their per-block scale (and minimum) included. Quantization is weight-only:
  the KV cache and activations stay 16-bit (``kv_dtype``), and norms stay float32 as GGUF keeps them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any

from llmlib.config import PRESETS, ModelConfig, get_config

# ---------------------------------------------------------------------------------------------
# dtypes: bytes per stored value
# ---------------------------------------------------------------------------------------------

#: Bytes per parameter. GGUF block formats store 32 weights per block plus a float16 scale
#: (Q8_0: 32 + 2 = 34 bytes, Q4_0: 16 + 2 = 18 bytes) and, for Q4_1, a float16 minimum too (20 bytes).
DTYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "fp32": 4.0,
    "float32": 4.0,
    "bf16": 2.0,
    "bfloat16": 2.0,
    "f16": 2.0,
    "fp16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "fp8": 1.0,
    "int4": 0.5,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
}

#: dtypes that hold activations and caches (anything else is a weight-only quantization).
FLOAT_DTYPES = {"f32", "fp32", "float32", "bf16", "bfloat16", "f16", "fp16", "float16"}


def bytes_per_param(dtype: str) -> float:
    """Bytes one stored value takes at ``dtype`` (``bf16`` -> 2, ``q4_1`` -> 0.625, ...)."""
    key = str(dtype).lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def _default_kv_dtype(dtype: str) -> str:
    """The cache and activations keep the weights' float dtype, or bf16 under weight-only quantization."""
    return str(dtype).lower() if str(dtype).lower() in FLOAT_DTYPES else "bf16"


# ---------------------------------------------------------------------------------------------
# GPUs: datasheet bandwidth and dense bf16 throughput
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    """One accelerator's two ceilings, as its vendor publishes them.

    ``bf16_tflops`` is *dense* bf16 tensor-core throughput (datasheets headline the 2:4-sparse
    figure, which is twice this). ``ridge`` is the arithmetic intensity (FLOPs per byte) above
    which a kernel is compute-bound on this chip.
    """

    name: str
    bandwidth_tbs: float  # TB/s (1e12 bytes/s) of device memory bandwidth
    bf16_tflops: float  # dense bf16 tensor-core TFLOP/s
    memory_gb: float  # device memory capacity, GB
    source: str

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_tbs * 1e12

    @property
    def flops(self) -> float:
        """Dense bf16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the compute roof meets the bandwidth roof."""
        return self.flops / self.bandwidth


GPUS: dict[str, GPU] = {
    "h100-sxm": GPU(
        "NVIDIA H100 SXM 80GB", 3.35, 989.0, 80,
        "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3; BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense",
    ),
    "h200": GPU(
        "NVIDIA H200 SXM 141GB", 4.8, 989.0, 141,
        "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e; BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense",
    ),
    "a100-80gb": GPU(
        "NVIDIA A100 80GB SXM", 2.039, 312.0, 80,
        "NVIDIA A100 Tensor Core GPU datasheet: 2,039 GB/s HBM2e (80GB SXM); BF16 Tensor Core 312 TFLOPS dense (624 sparse)",
    ),
    "l4": GPU(
        "NVIDIA L4 24GB", 0.300, 121.0, 24,
        "NVIDIA L4 Tensor Core GPU datasheet: 300 GB/s GDDR6; BF16 Tensor Core 242 TFLOPS with sparsity -> 121 dense",
    ),
    "rtx-4090": GPU(
        "NVIDIA GeForce RTX 4090 24GB", 1.008, 165.2, 24,
        "NVIDIA Ada GPU Architecture whitepaper, RTX 4090 column: 1,008 GB/s GDDR6X; peak BF16 Tensor TFLOPS "
        "with FP32 accumulate 165.2 dense (330.4 sparse). (82.6 is its FP32/TF32 rate, not bf16.)",
    ),
}


def get_gpu(name_or_gpu: "str | GPU") -> GPU:
    """A GPU from :data:`GPUS` by key (``h100-sxm``, ``h200``, ``a100-80gb``, ``l4``, ``rtx-4090``)."""
    if isinstance(name_or_gpu, GPU):
        return name_or_gpu
    key = str(name_or_gpu).lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {name_or_gpu!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


# ---------------------------------------------------------------------------------------------
# parameters by component
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, by component. ``*_per_layer`` fields are for ONE layer.

    For a mixture of experts, ``ffn_gate/up/down`` count *all* experts and ``router`` the gating
    matrix; ``ffn_active_per_layer`` is what one token actually multiplies by (its top-k experts
    and the router).
    """

    embedding: int
    lm_head: int  # 0 when tied to the embedding (no extra parameters; still read at decode)
    final_norm: int
    attn_q: int
    attn_k: int
    attn_v: int
    attn_o: int
    attn_norm: int
    ffn_norm: int
    ffn_gate: int
    ffn_up: int
    ffn_down: int
    router: int
    ffn_active_per_layer: int
    n_layers: int
    tied: bool

    @property
    def attention_per_layer(self) -> int:
        return self.attn_q + self.attn_k + self.attn_v + self.attn_o

    @property
    def ffn_per_layer(self) -> int:
        return self.ffn_gate + self.ffn_up + self.ffn_down + self.router

    @property
    def norms_per_layer(self) -> int:
        return self.attn_norm + self.ffn_norm

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.ffn_per_layer + self.norms_per_layer

    @property
    def layers_total(self) -> int:
        return self.per_layer * self.n_layers

    @property
    def lm_head_read(self) -> int:
        """Parameters the output projection reads per pass: the embedding table itself when tied."""
        return self.embedding if self.tied else self.lm_head

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.final_norm + self.layers_total

    @property
    def active_per_layer(self) -> int:
        """Parameters one token multiplies by in one layer (differs from per_layer only for MoE)."""
        return self.attention_per_layer + self.ffn_active_per_layer + self.norms_per_layer

    @property
    def matmul_active(self) -> int:
        """Parameters in matmuls one token passes through: every layer's active weights and the LM
        head. (The embedding is a lookup, not a matmul; norms are elementwise.)"""
        return self.n_layers * (self.attention_per_layer + self.ffn_active_per_layer) + self.lm_head_read

    @property
    def ffn_share(self) -> float:
        """Fraction of one layer's parameters that sit in the feed-forward network."""
        return self.ffn_per_layer / self.per_layer


def param_counts(cfg: "ModelConfig | str") -> ParamCounts:
    """Count a Llama-family model's parameters component by component from its shape."""
    cfg = get_config(cfg)
    D, hd = cfg.d_model, cfg.head_dim
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    experts = cfg.n_experts or 1
    one_expert = cfg.ffn_dim * D  # each of gate, up, down
    router = cfg.n_experts * D if cfg.n_experts else 0
    active_experts = cfg.n_experts_per_token if cfg.n_experts else 1
    return ParamCounts(
        embedding=cfg.vocab_size * D,
        lm_head=0 if cfg.tie_embeddings else cfg.vocab_size * D,
        final_norm=D,
        attn_q=q_out * D,
        attn_k=kv_out * D,
        attn_v=kv_out * D,
        attn_o=D * q_out,
        attn_norm=D,
        ffn_norm=D,
        ffn_gate=experts * one_expert,
        ffn_up=experts * one_expert,
        ffn_down=experts * one_expert,
        router=router,
        ffn_active_per_layer=active_experts * 3 * one_expert + router,
        n_layers=cfg.n_layers,
        tied=cfg.tie_embeddings,
    )


# ---------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------


def _norm_bytes_per_param(dtype: str) -> float:
    # Norm vectors are tiny and GGUF keeps them float32; a float model keeps them in its own dtype.
    return bytes_per_param(dtype) if str(dtype).lower() in FLOAT_DTYPES else 4.0


def layer_bytes(cfg: "ModelConfig | str", dtype: str = "bf16") -> float:
    """Bytes of ONE layer's weights (all experts for a MoE)."""
    p = param_counts(cfg)
    return (p.attention_per_layer + p.ffn_per_layer) * bytes_per_param(dtype) + p.norms_per_layer * _norm_bytes_per_param(dtype)


def layer_active_bytes(cfg: "ModelConfig | str", dtype: str = "bf16", experts_read: float | None = None) -> float:
    """Bytes of one layer's weights a forward pass reads.

    Dense: the whole layer. MoE: the router plus ``experts_read`` experts (default: the top-k of one
    token, i.e. batch 1).
    """
    cfg = get_config(cfg)
    p = param_counts(cfg)
    if cfg.n_experts:
        k = cfg.n_experts_per_token if experts_read is None else experts_read
        ffn = k * 3 * cfg.ffn_dim * cfg.d_model + p.router
    else:
        ffn = p.ffn_per_layer
    return (p.attention_per_layer + ffn) * bytes_per_param(dtype) + p.norms_per_layer * _norm_bytes_per_param(dtype)


def weight_bytes(cfg: "ModelConfig | str", dtype: str = "bf16") -> float:
    """Bytes of the whole model on disk / in memory (tied embeddings stored once)."""
    p = param_counts(cfg)
    b = bytes_per_param(dtype)
    return (p.embedding + p.lm_head) * b + p.final_norm * _norm_bytes_per_param(dtype) + p.n_layers * layer_bytes(cfg, dtype)


def pass_weight_bytes(cfg: "ModelConfig | str", dtype: str = "bf16", experts_read: float | None = None) -> float:
    """Weight bytes one forward pass reads: every layer, the final norm and the full LM head.

    The embedding rows a pass looks up are counted separately (they scale with tokens, not with
    the model): see :func:`embedding_row_bytes`.
    """
    cfg = get_config(cfg)
    p = param_counts(cfg)
    return (
        cfg.n_layers * layer_active_bytes(cfg, dtype, experts_read)
        + p.final_norm * _norm_bytes_per_param(dtype)
        + p.lm_head_read * bytes_per_param(dtype)
    )


def expected_experts_read(cfg: "ModelConfig | str", tokens: int) -> float:
    """Experts per layer a pass over ``tokens`` token-rows touches, if routing were uniform:
    ``E * (1 - (1 - k/E)**tokens)``. One token reads its k experts; a big batch reads them all.
    For a dense model, 1."""
    cfg = get_config(cfg)
    if not cfg.n_experts:
        return 1.0
    E, k = cfg.n_experts, cfg.n_experts_per_token
    return E * (1.0 - (1.0 - k / E) ** max(int(tokens), 1))


def embedding_row_bytes(cfg: "ModelConfig | str", dtype: str = "bf16") -> float:
    """Bytes one token's embedding lookup copies (one row of the table)."""
    return get_config(cfg).d_model * bytes_per_param(dtype)


def kv_bytes_per_token(cfg: "ModelConfig | str", kv_dtype: str = "bf16") -> float:
    """KV-cache bytes per token: keys and values (the 2) for every layer, KV head and head dimension."""
    cfg = get_config(cfg)
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_param(kv_dtype)


def activation_bytes_per_token(cfg: "ModelConfig | str", act_dtype: str = "bf16") -> float:
    """Activation traffic per token per pass, if every matmul reads its input and writes its output
    once (no fusion beyond that): a lower bound of what unfused kernels move, tiny next to weights
    at small batch. Includes the logits row (float32)."""
    cfg = get_config(cfg)
    D, F = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    k = cfg.n_experts_per_token if cfg.n_experts else 1
    per_layer = (
        D + (q + 2 * kv)  # norm output read by QKV, QKV written
        + 2 * q + D  # attention output read by W_O (written by attention), W_O output
        + D + k * (2 * F + F + D)  # FFN input; gate/up outputs; down input; down output
    )
    return cfg.n_layers * per_layer * bytes_per_param(act_dtype) + cfg.vocab_size * 4.0


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def attention_flops_per_token(cfg: "ModelConfig | str", context: int) -> float:
    """FLOPs of score and mix (``QK^T`` and ``PV``) for one query over ``context`` positions, all layers."""
    cfg = get_config(cfg)
    return 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context


def flops_per_token(cfg: "ModelConfig | str", context: int = 0) -> float:
    """FLOPs for one token's forward pass at a context of ``context`` positions (itself included)."""
    return 2.0 * param_counts(cfg).matmul_active + attention_flops_per_token(cfg, context)


def prefill_flops(cfg: "ModelConfig | str", tokens: int, past: int = 0) -> float:
    """FLOPs of one prefill of ``tokens`` new tokens after ``past`` cached ones (causal: token i sees
    ``past + i + 1`` positions)."""
    cfg = get_config(cfg)
    pairs = tokens * past + tokens * (tokens + 1) / 2  # sum over the new tokens of their context
    return tokens * 2.0 * param_counts(cfg).matmul_active + 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs


# ---------------------------------------------------------------------------------------------
# the whole request
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """What one request (``prompt_tokens`` in, ``output_tokens`` out, batch 1) costs one model on one GPU.

    Byte figures are bytes, times are seconds unless the name says ms. Index it like a dict
    (``c["weight_bytes"]``) or use :meth:`as_dict`.
    """

    model: str
    gpu: str
    dtype: str
    kv_dtype: str
    prompt_tokens: int
    output_tokens: int
    # parameters
    params_total: int
    params_embedding: int
    params_lm_head: int
    params_per_layer: int
    params_attention_per_layer: int
    params_ffn_per_layer: int
    params_active_per_token: int
    ffn_param_share: float
    # bytes
    weight_bytes: float
    embedding_bytes: float
    lm_head_bytes: float  # bytes the LM head reads per pass (the embedding table when tied)
    bytes_per_layer: float
    decode_weight_bytes_per_token: float  # layers + final norm + LM head + one embedding row
    kv_bytes_per_token: float
    prompt_kv_bytes: float
    final_kv_bytes: float
    decode_bytes_per_token: float  # weights + the KV cache read at the last step
    total_weight_traffic_bytes: float
    # FLOPs and intensity
    flops_per_token: float
    prefill_flops: float
    prefill_bytes: float
    prefill_intensity: float
    decode_flops_per_token: float
    decode_intensity: float
    gpu_ridge: float
    # time
    prefill_ms: float
    prefill_bound: str
    decode_ms_per_token: float  # the bandwidth floor at batch 1 (first decode step)
    decode_tokens_per_s: float
    decode_total_s: float
    total_s: float
    fits_in_gpu_memory: bool

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _step_time(flops: float, nbytes: float, gpu: GPU) -> tuple[float, str]:
    t_compute, t_memory = flops / gpu.flops, nbytes / gpu.bandwidth
    return (t_compute, "compute") if t_compute > t_memory else (t_memory, "memory")


def costs(
    model: "ModelConfig | str",
    gpu: "GPU | str" = "h100-sxm",
    prompt_tokens: int = 7,
    output_tokens: int = 184,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
) -> Costs:
    """The cost of answering one prompt at batch 1: parameters, bytes, FLOPs, and the roofline floor.

    Times are lower bounds: each pass takes the larger of (FLOPs / peak FLOP/s) and (bytes / peak
    bandwidth). Prefill is one pass over the prompt and produces the first output token; each of
    the other ``output_tokens - 1`` tokens is a decode step that reads every weight once plus the
    KV cache so far. ``decode_ms_per_token`` is the first decode step's floor (at short contexts
    the cache is negligible; :attr:`Costs.decode_total_s` sums the actual growing steps).
    """
    cfg = get_config(model)
    g = get_gpu(gpu)
    for name, v, lo in (("prompt_tokens", prompt_tokens, 1), ("output_tokens", output_tokens, 1)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    kv_dtype = kv_dtype or _default_kv_dtype(dtype)
    bytes_per_param(kv_dtype)  # validate early
    p = param_counts(cfg)
    b = bytes_per_param(dtype)
    kv_tok = kv_bytes_per_token(cfg, kv_dtype)
    pass_w = pass_weight_bytes(cfg, dtype)
    row = embedding_row_bytes(cfg, dtype)
    act = activation_bytes_per_token(cfg, kv_dtype)

    # prefill: the weights once, the prompt's embedding rows, its KV written, its activations
    pf_flops = prefill_flops(cfg, prompt_tokens)
    pf_w = pass_weight_bytes(cfg, dtype, experts_read=expected_experts_read(cfg, prompt_tokens) if cfg.n_experts else None)
    pf_bytes = pf_w + prompt_tokens * (row + kv_tok + act)
    t_pf, pf_bound = _step_time(pf_flops, pf_bytes, g)

    # decode: step j (1-based) feeds output token j at position prompt+j-1 and reads the cache so far
    def step(ctx_before: int) -> tuple[float, float]:
        flops = flops_per_token(cfg, ctx_before + 1)
        nbytes = pass_w + row + ctx_before * kv_tok + kv_tok + act
        return flops, nbytes

    first_flops, first_bytes = step(prompt_tokens)
    t_first, _ = _step_time(first_flops, first_bytes, g)
    decode_steps = output_tokens - 1
    t_decode = sum(_step_time(*step(prompt_tokens + j), g)[0] for j in range(decode_steps))
    last_flops, last_bytes = step(prompt_tokens + max(decode_steps - 1, 0))

    decode_w = pass_w + row
    return Costs(
        model=cfg.name,
        gpu=g.name,
        dtype=dtype,
        kv_dtype=kv_dtype,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        params_total=p.total,
        params_embedding=p.embedding,
        params_lm_head=p.lm_head,
        params_per_layer=p.per_layer,
        params_attention_per_layer=p.attention_per_layer,
        params_ffn_per_layer=p.ffn_per_layer,
        params_active_per_token=p.matmul_active,
        ffn_param_share=p.ffn_share,
        weight_bytes=weight_bytes(cfg, dtype),
        embedding_bytes=p.embedding * b,
        lm_head_bytes=p.lm_head_read * b,
        bytes_per_layer=layer_bytes(cfg, dtype),
        decode_weight_bytes_per_token=decode_w,
        kv_bytes_per_token=kv_tok,
        prompt_kv_bytes=prompt_tokens * kv_tok,
        final_kv_bytes=(prompt_tokens + output_tokens) * kv_tok,
        decode_bytes_per_token=first_bytes,
        total_weight_traffic_bytes=(1 + decode_steps) * pass_w,
        flops_per_token=flops_per_token(cfg, prompt_tokens + 1),
        prefill_flops=pf_flops,
        prefill_bytes=pf_bytes,
        prefill_intensity=pf_flops / pf_bytes,
        decode_flops_per_token=first_flops,
        decode_intensity=first_flops / first_bytes,
        gpu_ridge=g.ridge,
        prefill_ms=t_pf * 1e3,
        prefill_bound=pf_bound,
        decode_ms_per_token=t_first * 1e3,
        decode_tokens_per_s=1.0 / t_first,
        decode_total_s=t_decode,
        total_s=t_pf + t_decode,
        fits_in_gpu_memory=weight_bytes(cfg, dtype) + (prompt_tokens + output_tokens) * kv_tok <= g.memory_gb * 1e9,
    )


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:,.0f} B"


def format_table(c: Costs) -> str:
    """A readable report of :func:`costs`."""
    rows = [
        ("model", f"{c.model}  ({c.dtype} weights, {c.kv_dtype} KV cache)"),
        ("gpu", f"{c.gpu}  (ridge {c.gpu_ridge:,.0f} FLOP/byte)"),
        ("request", f"{c.prompt_tokens} prompt tokens -> {c.output_tokens} output tokens, batch 1"),
        ("", ""),
        ("parameters", f"{c.params_total:,}"),
        ("  embedding", f"{c.params_embedding:,}"),
        ("  per layer", f"{c.params_per_layer:,}  (attention {c.params_attention_per_layer:,}, FFN {c.params_ffn_per_layer:,})"),
        ("  FFN share of a layer", f"{c.ffn_param_share:.1%}"),
        ("  LM head", f"{c.params_lm_head:,}" + ("  (tied: reads the embedding table)" if c.params_lm_head == 0 else "")),
        ("weights", _fmt_bytes(c.weight_bytes)),
        ("  embedding table", _fmt_bytes(c.embedding_bytes)),
        ("  one layer", _fmt_bytes(c.bytes_per_layer)),
        ("  LM head (read per step)", _fmt_bytes(c.lm_head_bytes)),
        ("KV cache per token", f"{c.kv_bytes_per_token:,.0f} B"),
        ("  after the prompt", _fmt_bytes(c.prompt_kv_bytes)),
        ("  at the end", _fmt_bytes(c.final_kv_bytes)),
        ("", ""),
        ("prefill", f"{c.prefill_flops / 1e12:,.2f} TFLOP over {_fmt_bytes(c.prefill_bytes)}: "
                    f"{c.prefill_intensity:,.1f} FLOP/byte, {c.prefill_bound}-bound, >= {c.prefill_ms:,.2f} ms"),
        ("decode step", f"{c.decode_flops_per_token / 1e9:,.1f} GFLOP over {_fmt_bytes(c.decode_bytes_per_token)}: "
                        f"{c.decode_intensity:,.2f} FLOP/byte"),
        ("decode floor", f"{c.decode_ms_per_token:,.2f} ms/token  ({c.decode_tokens_per_s:,.1f} tokens/s)"),
        ("decode total", f"{c.decode_total_s:,.2f} s for {c.output_tokens - 1} steps"),
        ("weight traffic", f"{_fmt_bytes(c.total_weight_traffic_bytes)}  ({c.output_tokens} passes over the weights)"),
        ("request floor", f"{c.total_s:,.2f} s" + ("" if c.fits_in_gpu_memory else "  (does not fit in one GPU's memory: shard it)")),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" if k else "" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib costs", description="What a model costs to run: parameters, bytes, KV cache, and the decode floor on a GPU.")
    ap.add_argument("--model", default="llama-3-70b", help=f"preset ({', '.join(PRESETS)}) or a config.json path")
    ap.add_argument("--gpu", default="h100-sxm", choices=list(GPUS))
    ap.add_argument("--prompt-tokens", type=int, default=7)
    ap.add_argument("--output-tokens", type=int, default=184)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--kv-dtype", default=None, choices=sorted(FLOAT_DTYPES), help="KV cache dtype (default: the weights' float dtype, else bf16)")
    ap.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    args = ap.parse_args(argv)
    try:
        cfg = ModelConfig.from_json(args.model) if args.model.endswith(".json") else get_config(args.model)
        c = costs(cfg, args.gpu, args.prompt_tokens, args.output_tokens, args.dtype, args.kv_dtype)
    except (KeyError, ValueError, OSError) as e:
        print(f"llmlib costs: {e}", file=sys.stderr)
        return 2
    print(json.dumps(c.as_dict(), indent=2) if args.json else format_table(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
