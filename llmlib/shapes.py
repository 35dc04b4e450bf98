"""The shape table: every tensor a model of a given configuration holds, by name, and its shape.

One table serves everything that needs to know what a checkpoint must contain: the loaders check
a state dict against it (:func:`llmlib.checkpoints.build.check_state_dict`), and the cost model
counts parameters from it (:func:`llmlib.analysis.costs.param_counts`). It is plain arithmetic on a
:class:`~llmlib.config.ModelConfig`, with no torch, so ``llmlib costs`` runs without importing it.

The names are llmlib's own (``layers.3.attn.wq.weight``), the contract every loader maps a
checkpoint's names onto; :class:`llmlib.model.Transformer` builds exactly these parameters.
"""

from __future__ import annotations

from llmlib.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a model of ``cfg``, in llmlib's names, with its shape, in load order.

    Beyond Llama's tensors, a family may add (see :mod:`llmlib.families`): biases on the q, k, v
    and output projections, an RMSNorm gain over each head's queries and keys (``attn.q_norm``,
    ``attn.k_norm``, one ``head_dim`` vector each), norms on each sub-layer's output
    (``attn_post_norm``, ``ffn_post_norm``), and, in a mixture of experts, dense layers among the
    routed ones, whose experts have their own width.
    """
    D, hd = cfg.d_model, cfg.head_dim
    q_rows, kv_rows = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, D)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes[p + "attn.wq.weight"] = (q_rows, D)
        shapes[p + "attn.wk.weight"] = (kv_rows, D)
        shapes[p + "attn.wv.weight"] = (kv_rows, D)
        if cfg.qkv_bias:
            shapes[p + "attn.wq.bias"] = (q_rows,)
            shapes[p + "attn.wk.bias"] = (kv_rows,)
            shapes[p + "attn.wv.bias"] = (kv_rows,)
        if cfg.qk_norm:
            shapes[p + "attn.q_norm.weight"] = (hd,)
            shapes[p + "attn.k_norm.weight"] = (hd,)
        shapes[p + "attn.wo.weight"] = (D, q_rows)
        if cfg.out_bias:
            shapes[p + "attn.wo.bias"] = (D,)
        if cfg.post_norms:
            shapes[p + "attn_post_norm.weight"] = (D,)
        shapes[p + "ffn_norm.weight"] = (D,)
        ffns, F = [p + "ffn."], cfg.ffn_dim
        if cfg.is_moe(i):
            shapes[p + "ffn.router.weight"] = (cfg.n_experts, D)
            ffns, F = [f"{p}ffn.experts.{e}." for e in range(cfg.n_experts)], cfg.expert_dim
        for f in ffns:
            shapes[f + "w_gate.weight"] = (F, D)
            shapes[f + "w_up.weight"] = (F, D)
            shapes[f + "w_down.weight"] = (D, F)
        if cfg.post_norms:
            shapes[p + "ffn_post_norm.weight"] = (D,)
    shapes["norm.weight"] = (D,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def kv_cache_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, bytes_per_element: float
) -> float:
    """Chapter 1's formula: keys and values (the 2), for every layer, KV head and token.

    The static cache, the paged pool, the engine's sizing and the cost model all use it.
    """
    return 2 * n_layers * n_kv_heads * head_dim * tokens * bytes_per_element
