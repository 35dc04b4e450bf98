"""The cost model: what a model configuration costs in parameters, bytes, FLOPs and seconds.

Everything here is arithmetic on a :class:`~llmlib.config.ModelConfig`; nothing is measured and
no figure is typed in. The book's chapter 1 uses it to reproduce the Llama-3-70B numbers
(bytes per layer, KV cache per token, the decode floor on an H100) and chapter 9 builds its
roofline on the same counts, so there is exactly one place where parameters are counted. It stays
one module, longer than most, because it is read as one piece: a few lines of arithmetic per
function, all on the same counts, in the order a request spends them.

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

from dataclasses import asdict, dataclass, fields
from typing import Any

from llmlib.analysis.gpus import GPU, GPUS, get_gpu  # noqa: F401 - GPUS re-exported: a cost is per GPU
from llmlib.config import ModelConfig, get_config
from llmlib.dtypes import bytes_per_element, canonical, is_float
from llmlib.shapes import kv_cache_bytes, numel, param_shapes


def bytes_per_param(dtype: str) -> float:
    """Bytes one stored value takes at ``dtype`` (``bf16`` -> 2, ``q4_1`` -> 0.625, ...)."""
    return bytes_per_element(dtype)


def _default_kv_dtype(dtype: str) -> str:
    """The cache and activations keep the weights' float dtype, or bf16 under weight-only quantization."""
    return canonical(dtype) if is_float(dtype) else "bfloat16"


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
    layers_sum: int | None = None  # every layer's parameters, when layers differ (Qwen3-MoE)

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
        return self.per_layer * self.n_layers if self.layers_sum is None else self.layers_sum

    @property
    def lm_head_read(self) -> int:
        """Parameters the output projection reads per pass: the embedding table itself when tied."""
        return self.embedding if self.tied else self.lm_head

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.final_norm + self.layers_total

    @property
    def matmul_active(self) -> int:
        """Parameters in matmuls one token passes through: every layer's active weights and the LM
        head. (The embedding is a lookup, not a matmul; norms are elementwise.)"""
        return (
            self.n_layers * (self.attention_per_layer + self.ffn_active_per_layer)
            + self.lm_head_read
        )

    @property
    def ffn_share(self) -> float:
        """Fraction of one layer's parameters that sit in the feed-forward network."""
        return self.ffn_per_layer / self.per_layer


def param_counts(cfg: ModelConfig | str) -> ParamCounts:
    """Count a model's parameters component by component, from the one shape table.

    :func:`llmlib.shapes.param_shapes` lists every tensor a checkpoint of ``cfg`` holds; the
    components here are sums over it (one layer stands for every layer: the first routed one in a
    mixture of experts whose config keeps some layers dense, else layer 0; ``total`` sums them
    all). Biases count with their projection; per-head q/k norms and post-norms with the two norms.
    """
    cfg = get_config(cfg)
    shapes = param_shapes(cfg)
    rep = next((i for i in range(cfg.n_layers) if cfg.is_moe(i)), 0)

    def total(*suffixes: str, layer: int | None = rep) -> int:
        prefix = "" if layer is None else f"layers.{layer}."
        return sum(
            numel(s)
            for k, s in shapes.items()
            if k.startswith(prefix) and any(k.endswith(x) for x in suffixes)
        )

    router = total("ffn.router.weight")
    ffn_all = total("w_gate.weight") + total("w_up.weight") + total("w_down.weight")
    active = (
        cfg.n_experts_per_token * ffn_all // cfg.n_experts + router if cfg.n_experts else ffn_all
    )
    return ParamCounts(
        embedding=numel(shapes["embed.weight"]),
        lm_head=numel(shapes.get("lm_head.weight", ())) if "lm_head.weight" in shapes else 0,
        final_norm=numel(shapes["norm.weight"]),
        attn_q=total("attn.wq.weight", "attn.wq.bias"),
        attn_k=total("attn.wk.weight", "attn.wk.bias"),
        attn_v=total("attn.wv.weight", "attn.wv.bias"),
        attn_o=total("attn.wo.weight", "attn.wo.bias"),
        attn_norm=total(
            "attn_norm.weight", "attn_post_norm.weight", "q_norm.weight", "k_norm.weight"
        ),
        ffn_norm=total("ffn_norm.weight", "ffn_post_norm.weight"),
        ffn_gate=total("w_gate.weight"),
        ffn_up=total("w_up.weight"),
        ffn_down=total("w_down.weight"),
        router=router,
        ffn_active_per_layer=active,
        n_layers=cfg.n_layers,
        tied=cfg.tie_embeddings,
        layers_sum=sum(numel(s) for k, s in shapes.items() if k.startswith("layers.")),
    )


# ---------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------


def _norm_bytes_per_param(dtype: str) -> float:
    # Norm vectors are tiny and GGUF keeps them float32; a float model keeps them in its own dtype.
    return bytes_per_param(dtype) if is_float(dtype) else 4.0


def layer_bytes(cfg: ModelConfig | str, dtype: str = "bf16") -> float:
    """Bytes of ONE layer's weights (all experts for a MoE)."""
    p = param_counts(cfg)
    return (p.attention_per_layer + p.ffn_per_layer) * bytes_per_param(
        dtype
    ) + p.norms_per_layer * _norm_bytes_per_param(dtype)


def layer_active_bytes(
    cfg: ModelConfig | str, dtype: str = "bf16", experts_read: float | None = None
) -> float:
    """Bytes of one layer's weights a forward pass reads.

    Dense: the whole layer. MoE: the router plus ``experts_read`` experts (default: the top-k of one
    token, i.e. batch 1).
    """
    cfg = get_config(cfg)
    p = param_counts(cfg)
    if cfg.n_experts:
        k = cfg.n_experts_per_token if experts_read is None else experts_read
        ffn = k * (p.ffn_gate + p.ffn_up + p.ffn_down) / cfg.n_experts + p.router
    else:
        ffn = p.ffn_per_layer
    return (p.attention_per_layer + ffn) * bytes_per_param(
        dtype
    ) + p.norms_per_layer * _norm_bytes_per_param(dtype)


def weight_bytes(cfg: ModelConfig | str, dtype: str = "bf16") -> float:
    """Bytes of the whole model on disk / in memory (tied embeddings stored once)."""
    p = param_counts(cfg)
    b = bytes_per_param(dtype)
    return (
        (p.embedding + p.lm_head) * b
        + p.final_norm * _norm_bytes_per_param(dtype)
        + p.n_layers * layer_bytes(cfg, dtype)
    )


def pass_weight_bytes(
    cfg: ModelConfig | str, dtype: str = "bf16", experts_read: float | None = None
) -> float:
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


def expected_experts_read(cfg: ModelConfig | str, tokens: int) -> float:
    """Experts per layer a pass over ``tokens`` token-rows touches, if routing were uniform:
    ``E * (1 - (1 - k/E)**tokens)``. One token reads its k experts; a big batch reads them all.
    For a dense model, 1."""
    cfg = get_config(cfg)
    if not cfg.n_experts:
        return 1.0
    E, k = cfg.n_experts, cfg.n_experts_per_token
    return E * (1.0 - (1.0 - k / E) ** max(int(tokens), 1))


def embedding_row_bytes(cfg: ModelConfig | str, dtype: str = "bf16") -> float:
    """Bytes one token's embedding lookup copies (one row of the table)."""
    return get_config(cfg).d_model * bytes_per_param(dtype)


def kv_bytes_per_token(cfg: ModelConfig | str, kv_dtype: str = "bf16") -> float:
    """KV-cache bytes per token: keys and values (the 2) for every layer, KV head and head dimension."""
    cfg = get_config(cfg)
    return kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1, bytes_per_param(kv_dtype))


def activation_bytes_per_token(cfg: ModelConfig | str, act_dtype: str = "bf16") -> float:
    """Activation traffic per token per pass, if every matmul reads its input and writes its output
    once (no fusion beyond that): a lower bound of what unfused kernels move, tiny next to weights
    at small batch. Includes the logits row (float32)."""
    cfg = get_config(cfg)
    D, F = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    k = cfg.n_experts_per_token if cfg.n_experts else 1
    per_layer = (
        D
        + (q + 2 * kv)  # norm output read by QKV, QKV written
        + 2 * q
        + D  # attention output read by W_O (written by attention), W_O output
        + D
        + k * (2 * F + F + D)  # FFN input; gate/up outputs; down input; down output
    )
    return cfg.n_layers * per_layer * bytes_per_param(act_dtype) + cfg.vocab_size * 4.0


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def attention_flops_per_token(cfg: ModelConfig | str, context: int) -> float:
    """FLOPs of score and mix (``QK^T`` and ``PV``) for one query over ``context`` positions, all layers."""
    cfg = get_config(cfg)
    return 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context


def flops_per_token(cfg: ModelConfig | str, context: int = 0) -> float:
    """FLOPs for one token's forward pass at a context of ``context`` positions (itself included)."""
    return 2.0 * param_counts(cfg).matmul_active + attention_flops_per_token(cfg, context)


def prefill_flops(cfg: ModelConfig | str, tokens: int, past: int = 0) -> float:
    """FLOPs of one prefill of ``tokens`` new tokens after ``past`` cached ones (causal: token i sees
    ``past + i + 1`` positions)."""
    cfg = get_config(cfg)
    pairs = tokens * past + tokens * (tokens + 1) / 2  # sum over the new tokens of their context
    return (
        tokens * 2.0 * param_counts(cfg).matmul_active
        + 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs
    )


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
    model: ModelConfig | str,
    gpu: GPU | str = "h100-sxm",
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
    pf_w = pass_weight_bytes(
        cfg,
        dtype,
        experts_read=expected_experts_read(cfg, prompt_tokens) if cfg.n_experts else None,
    )
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
        fits_in_gpu_memory=weight_bytes(cfg, dtype) + (prompt_tokens + output_tokens) * kv_tok
        <= g.memory_gb * 1e9,
    )
