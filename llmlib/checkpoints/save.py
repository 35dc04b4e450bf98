"""A model written back out as a Hugging Face folder (``config.json`` + safetensors).

The inverse of :func:`llmlib.checkpoints.hf.read_hf_folder` for the Llama family: llmlib's names
back to Hugging Face's, the config back to ``config.json``'s fields. It exists so that tests,
benchmarks and the book can make a checkpoint *file* of any shape from random weights (a
tensor-parallel engine reads its slices from a file, never from another process's memory), and
``max_shard_bytes`` splits it over several files with an index, as large checkpoints are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmlib.model import Transformer

_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_name(key: str) -> str:
    """A llmlib parameter name as a Llama checkpoint on the hub names it."""
    if key in _GLOBAL:
        return _GLOBAL[key]
    _, layer, rest = key.split(".", 2)
    if rest not in _TO_HF:
        raise ValueError(f"save_hf_folder writes dense Llama-family models; {key!r} is not one")
    return f"model.layers.{layer}.{_TO_HF[rest]}"


def save_hf_folder(
    model: Transformer, folder: str | Path, max_shard_bytes: int | None = None
) -> Path:
    """Write ``model`` (a dense Llama-family model) to ``folder``; returns the folder."""
    cfg = model.config
    if cfg.family != "llama" or cfg.n_experts or cfg.qkv_bias or cfg.out_bias or cfg.qk_norm:
        raise ValueError(f"save_hf_folder writes plain Llama models, not {cfg.name} ({cfg.family})")
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    rs = cfg.rope_scaling
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if rs is None
        else {
            "rope_type": rs.rope_type,
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        },
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "torch_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
