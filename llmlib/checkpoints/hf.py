"""Hugging Face checkpoints: a folder with ``config.json`` and safetensors, in llmlib's names.

The weights are ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, in
whatever float dtype they were saved (the loader converts only if asked). The families of
:mod:`llmlib.families` mostly share Llama's tensor names; where one names a tensor differently
(Gemma's norms) or stores two as one (Phi-3's ``qkv_proj`` and ``gate_up_proj``) the tables there
say so, and :func:`hf_to_llmlib` follows them. Anything else is refused by name, so a checkpoint of
a different architecture cannot half-load. Only safetensors are read: pickle checkpoints
(``*.bin``) are not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmlib.config import ModelConfig
from llmlib.families import HF_FUSED, HF_RENAMES

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.w_gate.weight",
    "mlp.up_proj.weight": "ffn.w_up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
    # Mixtral, as published on the hub (one tensor per expert) ...
    "block_sparse_moe.gate.weight": "ffn.router.weight",
    # ... and as transformers 5 may name the router (Qwen3-MoE's name too)
    "mlp.gate.weight": "ffn.router.weight",
}
#: Tensors only some families have, and the config switch that says a model has them.
_OPTIONAL_NAMES = {
    "self_attn.q_proj.bias": ("attn.wq.bias", "qkv_bias"),
    "self_attn.k_proj.bias": ("attn.wk.bias", "qkv_bias"),
    "self_attn.v_proj.bias": ("attn.wv.bias", "qkv_bias"),
    "self_attn.o_proj.bias": ("attn.wo.bias", "out_bias"),
    "self_attn.q_norm.weight": ("attn.q_norm.weight", "qk_norm"),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", "qk_norm"),
}
_EXPERT_NAMES = {
    "w1": "w_gate",
    "w3": "w_up",
    "w2": "w_down",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(
    r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight"
)
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq")  # derived buffers that old checkpoints saved


def _fused_rows(cfg: ModelConfig, name: str) -> list[int]:
    """Row counts of the tensors a fused checkpoint tensor splits into (q, k, v or gate, up)."""
    if name.startswith("self_attn."):
        return [cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2
    return [cfg.ffn_dim, cfg.ffn_dim]


def _layer_tensor(cfg: ModelConfig, name: str, rest: str, p: str, t: torch.Tensor) -> dict:
    """One tensor of layer prefix ``p`` (``rest`` is its name after ``model.layers.N.``)."""
    renames = HF_RENAMES.get(cfg.family, {})
    if rest in renames:
        return {p + renames[rest]: t}
    if rest in _LAYER_NAMES:
        return {p + _LAYER_NAMES[rest]: t}
    if rest in _OPTIONAL_NAMES and getattr(cfg, _OPTIONAL_NAMES[rest][1]):
        return {p + _OPTIONAL_NAMES[rest][0]: t}
    if rest in HF_FUSED:
        rows = _fused_rows(cfg, rest)
        if t.dim() != 2 or t.shape[0] != sum(rows):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected {sum(rows)} rows "
                f"({' + '.join(map(str, rows))})"
            )
        return {p + ours: part for ours, part in zip(HF_FUSED[rest], t.split(rows, dim=0))}
    e = _EXPERT_RE.fullmatch(rest)
    if e:
        return {f"{p}ffn.experts.{e.group(1)}.{_EXPERT_NAMES[e.group(2)]}.weight": t}
    F = cfg.expert_dim
    if rest == "mlp.experts.gate_up_proj":  # transformers 5: every expert stacked [E, 2F, D]
        if t.dim() != 3 or t.shape[1] != 2 * F:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected [n_experts, 2*{F}, d_model]"
            )
        out = {}
        for j in range(t.shape[0]):
            out[f"{p}ffn.experts.{j}.w_gate.weight"] = t[j, :F]
            out[f"{p}ffn.experts.{j}.w_up.weight"] = t[j, F:]
        return out
    if rest == "mlp.experts.down_proj":
        if t.dim() != 3:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected [n_experts, d_model, {F}]"
            )
        return {f"{p}ffn.experts.{j}.w_down.weight": t[j] for j in range(t.shape[0])}
    raise ValueError(
        f"checkpoint has unexpected tensor {name!r}: not part of a {cfg.family} model "
        "of this config"
    )


def hf_to_llmlib(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict of ``cfg``'s family to llmlib's names.

    Also splits fused tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``) and transformers-5 stacked
    expert tensors (``mlp.experts.gate_up_proj [E, 2F, D]``, ``mlp.experts.down_proj [E, D, F]``)
    into llmlib's separate ones. Raises on any name it does not know, or that the config says the
    model does not have (a bias where ``qkv_bias`` is off), so a checkpoint of a different
    architecture cannot half-load.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        if _IGNORED_RE.fullmatch(name):
            continue
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = t
            continue
        if name == "model.norm.weight":
            out["norm.weight"] = t
            continue
        if name == "lm_head.weight":
            out["lm_head.weight"] = t
            continue
        m = _LAYER_RE.fullmatch(name)
        if m:
            out.update(_layer_tensor(cfg, name, m.group(2), f"layers.{m.group(1)}.", t))
            continue
        raise ValueError(
            f"checkpoint has unexpected tensor {name!r}: not part of a {cfg.family} model"
        )
    if cfg.tie_embeddings and "lm_head.weight" in out:
        # Some tied checkpoints store the shared matrix twice. A copy is harmless; a different matrix
        # means the config is wrong about tying, and silently dropping it would change the model.
        if (
            "embed.weight" in out
            and out["lm_head.weight"].shape == out["embed.weight"].shape
            and torch.equal(out["lm_head.weight"], out["embed.weight"])
        ):
            del out["lm_head.weight"]
        else:
            raise ValueError(
                "checkpoint has tensor 'lm_head.weight' that differs from the embeddings, "
                "but config.json says tie_word_embeddings=true"
            )
    return out


def read_hf_config(folder: Path) -> ModelConfig:
    """``config.json`` -> ModelConfig, with errors naming the missing or unsupported field."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    try:
        d = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf_dict(d, name=folder.name)
    except KeyError as e:
        raise ValueError(f"{cfg_path} lacks the field {e.args[0]!r}") from None


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one ``.safetensors`` file (on CPU), with a clear error for a damaged file."""
    from safetensors import safe_open

    try:
        out = {}
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
        return out
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(
            f"cannot read safetensors file {file} (truncated or corrupt?): {e}"
        ) from None


def read_hf_folder(
    folder: str | Path, read: Callable[[Path], dict[str, Any]] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (llmlib names) of a Hugging Face model folder.

    ``read`` reads one safetensors file (default :func:`read_safetensors`); a tensor-parallel rank
    passes :func:`llmlib.checkpoints.lazy.lazy_safetensors`, whose tensors are read on demand.
    """
    read = read or read_safetensors
    folder = Path(folder)
    cfg = read_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    hf_state: dict[str, Any] = {}
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise FileNotFoundError(
                    f"shard {shard} listed in {index.name} is missing from {folder}"
                )
            tensors = read(folder / shard)
            for name in tensors:
                if weight_map.get(name) != shard:
                    raise ValueError(
                        f"tensor {name!r} found in {shard} but {index.name} does not list it there"
                    )
            hf_state.update(tensors)
        absent = [n for n in weight_map if n not in hf_state]
        if absent:
            raise ValueError(
                f"tensor {absent[0]!r} is listed in {index.name} but absent from {weight_map[absent[0]]}"
            )
    elif single.is_file():
        hf_state = read(single)
    else:
        found = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(
            f"{folder} has no model.safetensors or model.safetensors.index.json (found {found}); "
            "pickle checkpoints (*.bin, *.pt) are deliberately not supported"
        )
    return cfg, hf_to_llmlib(cfg, hf_state)
