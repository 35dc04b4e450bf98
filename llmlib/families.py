"""Model families: what each one changes relative to Llama, and how its ``config.json`` reads.

Every family llmlib loads is the Llama block of chapter 6 with a few switches set: the fields at
the end of :class:`llmlib.config.ModelConfig` (``qkv_bias``, ``qk_norm``, ``sliding_window`` ...),
whose defaults are Llama's. :data:`FAMILIES` is the table of what each family sets and why;
:func:`hf_config_fields` reads a Hugging Face ``config.json`` into those fields, and
:data:`HF_RENAMES` / :data:`HF_FUSED` say where a family's checkpoint names its tensors unlike
Llama's. Anything that would change the arithmetic and that llmlib does not implement (an unknown
``model_type``, a RoPE scaling type, an activation, a layer type, a quantized checkpoint) is a
``ValueError`` naming the field, never a model that loads and computes something else.

Plain data and dictionaries (no torch), so :mod:`llmlib.config` can use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"  # the same names as llmlib.config's


@dataclass(frozen=True)
class Family:
    """One checkpoint family: its ``model_type``, what it changes, and where that shows up."""

    model_type: str
    name: str
    differs: str  # what differs from Llama, in one phrase
    fields: tuple[str, ...] = ()  # the ModelConfig fields it sets (beyond the shape)
    checkpoint: str = ""  # how its checkpoint's tensor names differ, if they do
    tied_default: bool = False  # tie_word_embeddings when config.json does not say


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama 2/3, SmolLM2", "the reference: every switch at its default"),
        Family(
            "mistral",
            "Mistral",
            "sliding-window attention on every layer when the config sets a window",
            ("sliding_window",),
        ),
        Family(
            "mixtral",
            "Mixtral",
            "routed experts: each token runs the top k of E SwiGLU FFNs",
            ("n_experts", "n_experts_per_token", "sliding_window"),
        ),
        Family(
            "qwen2",
            "Qwen2, Qwen2.5",
            "biases on q, k and v",
            ("qkv_bias", "sliding_window", "layer_types"),
        ),
        Family(
            "qwen3",
            "Qwen3",
            "RMSNorm over each head's q and k before RoPE; no biases",
            ("qk_norm", "sliding_window", "layer_types"),
        ),
        Family(
            "qwen3_moe",
            "Qwen3-MoE",
            "Qwen3 attention; routed experts of their own width, top-k weights renormalised "
            "only if norm_topk_prob; dense layers where the config says",
            ("qk_norm", "n_experts", "expert_ffn_dim", "norm_topk_prob", "dense_layers"),
        ),
        Family(
            "phi3",
            "Phi-3",
            "q, k, v stored as one tensor, gate and up as another",
            ("sliding_window",),
            checkpoint="qkv_proj and gate_up_proj are split on load",
        ),
        Family(
            "gemma2",
            "Gemma 2",
            "embeddings times sqrt(d); RMSNorm by (1 + w); a norm after each sub-layer too; "
            "GeGLU (tanh GELU); soft-capped scores and logits; local and global layers "
            "alternate; score scale from query_pre_attn_scalar",
            (
                "scale_embeddings",
                "norm_offset",
                "post_norms",
                "activation",
                "attn_softcap",
                "final_softcap",
                "sliding_window",
                "layer_types",
                "attn_scale",
            ),
            checkpoint="post_attention_layernorm is the post-norm; pre_feedforward_layernorm "
            "the FFN's norm",
            tied_default=True,
        ),
        Family(
            "gemma3_text",
            "Gemma 3 (text)",
            "Gemma 2's block with q/k RMSNorm instead of score capping; five local layers to "
            "one global; the local layers rotate with their own RoPE base",
            (
                "scale_embeddings",
                "norm_offset",
                "post_norms",
                "activation",
                "qk_norm",
                "sliding_window",
                "layer_types",
                "rope_local_theta",
                "attn_scale",
            ),
            checkpoint="as Gemma 2",
            tied_default=True,
        ),
    )
}

#: Per family, layer tensor names (after ``model.layers.N.``) that mean something else than in Llama.
HF_RENAMES: dict[str, dict[str, str]] = {
    fam: {
        "post_attention_layernorm.weight": "attn_post_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "ffn_post_norm.weight",
    }
    for fam in ("gemma2", "gemma3_text")
}
#: Fused checkpoint tensors and the llmlib tensors they split into, in order (Phi-3).
HF_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.gate_up_proj.weight": ("ffn.w_gate.weight", "ffn.w_up.weight"),
}


def supported() -> str:
    """The model_types llmlib reads, for error messages."""
    return ", ".join(sorted(FAMILIES))


# ---- config.json -> ModelConfig fields --------------------------------------------------------


def _unsupported(field: str, value: Any, why: str = "") -> ValueError:
    return ValueError(
        f"config.json sets {field}={value!r}, which llmlib does not implement"
        + (f" ({why})" if why else "")
        + "; loading it anyway would compute something else"
    )


def _rope(d: dict[str, Any], params: dict[str, Any] | None, scaling: Any, theta: float) -> dict:
    """``rope_theta`` and ``rope_scaling`` (a dict for :class:`~llmlib.config.RopeScaling`)."""
    params = dict(params or {})
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise _unsupported("partial_rotary_factor", factor, "RoPE on part of each head")
    scaling = dict(scaling or params)
    kind = scaling.get("rope_type", scaling.get("type"))
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": None}
    if kind in (None, "default"):
        return out
    if kind == "llama3":
        out["rope_scaling"] = {
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            "rope_type": "llama3",
        }
    elif kind == "linear":
        out["rope_scaling"] = {"factor": float(scaling["factor"]), "rope_type": "linear"}
    else:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r} in config.json "
            "(llmlib implements 'default', 'linear' and 'llama3')"
        )
    return out


def _common(d: dict[str, Any], fam: Family) -> dict[str, Any]:
    """The shape and the fields every family reads the same way."""
    if d.get("quantization_config"):
        method = d["quantization_config"].get("quant_method", "?")
        raise _unsupported("quantization_config", method, "a quantized checkpoint")
    n_heads = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    tied = d.get("tie_word_embeddings")
    return dict(
        family=fam.model_type,
        vocab_size=int(d["vocab_size"]),
        d_model=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        ffn_dim=int(d["intermediate_size"]),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // n_heads),
        max_seq_len=int(d.get("max_position_embeddings", 8192)),
        norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_embeddings=fam.tied_default if tied is None else bool(tied),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _plain_rope(d: dict[str, Any]) -> dict[str, Any]:
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10_000.0))
    return _rope(d, params, d.get("rope_scaling"), theta)


def _activation(d: dict[str, Any], key: str, want: str) -> None:
    act = d.get(key) or want
    if act != want:
        raise _unsupported(key, act, f"this family's FFN is built for {want!r}")


def _window_all_layers(d: dict[str, Any]) -> dict[str, Any]:
    """Mistral, Mixtral, Phi-3, Qwen3-MoE: a window, when set, applies to every layer."""
    w = d.get("sliding_window")
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        w = None
    return {"sliding_window": None if w is None else int(w)}


def _qwen_window(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Qwen2/Qwen3: a window only with use_sliding_window, on layers >= max_window_layers."""
    if not d.get("use_sliding_window") or d.get("sliding_window") is None:
        return {}
    types = d.get("layer_types") or [
        SLIDING if i >= int(d.get("max_window_layers", 28)) else FULL for i in range(n_layers)
    ]
    return {"sliding_window": int(d["sliding_window"]), "layer_types": tuple(types)}


def _llama(d: dict[str, Any], fam: Family) -> dict[str, Any]:
    f = _common(d, fam) | _plain_rope(d)
    _activation(d, "hidden_act", "silu")
    if d.get("mlp_bias"):
        raise _unsupported("mlp_bias", True, "biases in the FFN")
    if d.get("attention_bias"):
        f.update(qkv_bias=True, out_bias=True)
    if fam.model_type in ("mistral", "mixtral", "phi3"):
        f.update(_window_all_layers(d))
    if fam.model_type == "mixtral":
        f.update(
            n_experts=int(d.get("num_local_experts", 0) or 0),
            n_experts_per_token=int(d.get("num_experts_per_tok", 0) or 0),
        )
    return f


def _qwen(d: dict[str, Any], fam: Family) -> dict[str, Any]:
    f = _common(d, fam) | _plain_rope(d)
    _activation(d, "hidden_act", "silu")
    if fam.model_type == "qwen2":
        f["qkv_bias"] = True
    else:
        f["qk_norm"] = True
        if d.get("attention_bias"):
            f.update(qkv_bias=True, out_bias=True)
    if fam.model_type != "qwen3_moe":
        return f | _qwen_window(d, f["n_layers"])
    f.update(_window_all_layers(d))
    E = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)
    step = int(d.get("decoder_sparse_step", 1) or 1)
    only = set(d.get("mlp_only_layers") or ())
    dense = [i for i in range(f["n_layers"]) if i in only or not (E > 0 and (i + 1) % step == 0)]
    return f | dict(
        n_experts=E,
        n_experts_per_token=int(d.get("num_experts_per_tok", 0) or 0),
        expert_ffn_dim=int(d.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        dense_layers=tuple(dense),
    )


def _gemma(d: dict[str, Any], fam: Family) -> dict[str, Any]:
    f = _common(d, fam)
    _activation(d, "hidden_activation", "gelu_pytorch_tanh")
    if d.get("use_bidirectional_attention"):
        raise _unsupported("use_bidirectional_attention", True, "llmlib attends causally")
    if d.get("attention_bias"):
        f.update(qkv_bias=True, out_bias=True)
    n = f["n_layers"]
    gemma3 = fam.model_type == "gemma3_text"
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    types = d.get("layer_types") or [
        SLIDING if (i + 1) % (pattern if gemma3 else 2) else FULL for i in range(n)
    ]
    window = d.get("sliding_window", 4096)
    f.update(
        scale_embeddings=True,
        norm_offset=1.0,
        post_norms=True,
        activation="gelu_tanh",
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=d.get("final_logit_softcapping", None if gemma3 else 30.0),
    )
    if window is not None:
        f.update(sliding_window=int(window), layer_types=tuple(types))
    if not gemma3:
        f["attn_softcap"] = d.get("attn_logit_softcapping", 50.0)
        return f | _plain_rope(d)
    if d.get("attn_logit_softcapping") is not None:  # transformers' Gemma 3 does not apply it
        raise _unsupported("attn_logit_softcapping", d["attn_logit_softcapping"], "Gemma 3")
    params = d.get("rope_parameters") or {}
    glob, loc = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    f.update(qk_norm=True)
    f.update(
        _rope(d, glob, d.get("rope_scaling"), d.get("rope_theta", glob.get("rope_theta", 1e6)))
    )
    local = _rope(d, loc, None, d.get("rope_local_base_freq", loc.get("rope_theta", 10_000.0)))
    if local["rope_scaling"] is not None:
        raise _unsupported("rope_parameters.sliding_attention", loc, "scaled local RoPE")
    f["rope_local_theta"] = local["rope_theta"]
    return f


_READERS = {
    "llama": _llama,
    "mistral": _llama,
    "mixtral": _llama,
    "phi3": _llama,
    "qwen2": _qwen,
    "qwen3": _qwen,
    "qwen3_moe": _qwen,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
}


def hf_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (as a dict) -> :class:`~llmlib.config.ModelConfig` keyword
    arguments, ``rope_scaling`` as a dict. Raises ``ValueError`` for anything not implemented.

    transformers 5.x writes ``rope_parameters`` (with ``rope_theta`` inside; per layer type for
    Gemma 3); checkpoints on the hub carry ``rope_theta`` and ``rope_scaling`` at the top level.
    Both are read.
    """
    kind = d.get("model_type")
    arch = (kind or "").lower()
    if arch not in FAMILIES:
        hint = ""
        if arch == "gemma3":
            hint = " (Gemma 3 with its vision tower: llmlib reads the text-only gemma3_text)"
        raise ValueError(
            f"unsupported model_type {kind!r} in config.json{hint}; llmlib supports {supported()}"
        )
    return _READERS[arch](d, FAMILIES[arch])


def differences(cfg: Any) -> dict[str, Any]:
    """The family fields of a :class:`~llmlib.config.ModelConfig` that differ from Llama's."""
    fields = {f.name: f.default for f in dataclasses.fields(cfg)}
    start = list(fields).index("qkv_bias")
    return {
        k: getattr(cfg, k)
        for k in list(fields)[start:] + ["n_experts", "n_experts_per_token"]
        if getattr(cfg, k) != fields[k]
    }
