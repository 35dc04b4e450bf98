"""The shape table: every tensor a model of a given configuration holds, by name, and its shape.

One table serves everything that needs to know what a checkpoint must contain: the loaders check
a state dict against it (:func:`llmlib.checkpoints.build.check_state_dict`), and the cost model
counts parameters from it (:func:`llmlib.costs.param_counts`). It is plain arithmetic on a
:class:`~llmlib.config.ModelConfig`, with no torch, so ``llmlib costs`` runs without importing it.

The names are llmlib's own (``layers.3.attn.wq.weight``), the contract every loader maps a
checkpoint's names onto; :class:`llmlib.model.Transformer` builds exactly these parameters.
"""

from __future__ import annotations

from llmlib.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a model of ``cfg``, in llmlib's names, with its shape, in load order."""
    D, F, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, D)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes[p + "attn.wq.weight"] = (cfg.n_heads * hd, D)
        shapes[p + "attn.wk.weight"] = (cfg.n_kv_heads * hd, D)
        shapes[p + "attn.wv.weight"] = (cfg.n_kv_heads * hd, D)
        shapes[p + "attn.wo.weight"] = (D, cfg.n_heads * hd)
        shapes[p + "ffn_norm.weight"] = (D,)
        ffns = [p + "ffn."]
        if cfg.n_experts:
            shapes[p + "ffn.router.weight"] = (cfg.n_experts, D)
            ffns = [f"{p}ffn.experts.{e}." for e in range(cfg.n_experts)]
        for f in ffns:
            shapes[f + "w_gate.weight"] = (F, D)
            shapes[f + "w_up.weight"] = (F, D)
            shapes[f + "w_down.weight"] = (D, F)
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
