"""A Hugging Face folder -> a GGUF file, written the way llama.cpp's ``convert_hf_to_gguf.py``
writes that architecture (for the tests: tests/test_gguf_families.py).

Written from reading llama.cpp's converter, not copied: per architecture, the metadata keys its
model class writes (``TextModel.set_gguf_parameters`` and the class's own additions), the tensor
names (the ``gguf`` package's ``TensorNameMap``, which the converter itself uses), and what it does
to the numbers:

=============  ========  ======================================================================
model_type     arch      what the converter changes
=============  ========  ======================================================================
llama,         llama     rows of W_q and W_k permuted per head (``LlamaModel.permute``, with the
mistral                  key heads for W_k); vocab size and rope dimension written; no window
qwen2, qwen3   same      nothing beyond the generic keys
qwen3_moe      qwen3moe  experts stacked into ``ffn_{gate,up,down}_exps`` ``[E, out, in]``, the
                         router ``ffn_gate_inp`` (kept F32), ``expert_feed_forward_length``
phi3           phi3      ``qkv_proj`` and ``gate_up_proj`` kept fused (``attn_qkv``, ``ffn_up``);
                         its own key set: rope dimension, original context, window (0 for none)
gemma2         gemma2    every ``*norm.weight`` + 1, ``lm_head`` dropped; caps and window written,
                         no RoPE base
gemma3_text    gemma3    the same + 1 (q/k norms too); generic keys, local RoPE base as
                         ``rope.freq_base_swa``, final cap if set, window
=============  ========  ======================================================================

Tensor types as the converter's ``prepare_tensors``: 1-D tensors, ``*_norm.weight`` and the
router in F32, every other matrix (embeddings and head too) in the file type; a matrix the type
cannot hold (a row not a multiple of its block) falls back to F16, as there. The converter's own
file types are F32, F16, BF16 and Q8_0; Q4_0 (``llama-quantize``'s) is accepted as well. The
folders have no tokenizer, so no vocabulary is written (nor Gemma 3's embedding rows cut to it).

``extras=True`` also writes, under keys and names llama.cpp defines, what its converter drops but
the model needs (llmlib reads them, see :mod:`llmlib.checkpoints.gguf_arch`): Mistral's window as
``llama.attention.sliding_window``; Qwen3-MoE's ``norm_topk_prob=false`` as
``expert_weights_norm``, and a dense layer (``mlp_only_layers``) under the dense FFN names, which
llama.cpp's converter cannot map (``extras=False`` refuses it, as it does).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file
from test_gguf import hf_to_gguf_permute

ARCH_OF = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}
FILE_TYPE = {
    T.F32: gguf.LlamaFileType.ALL_F32,
    T.F16: gguf.LlamaFileType.MOSTLY_F16,
    T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
}


def convert(folder: Path, out: Path, qtype: T = T.F32, extras: bool = True) -> Path:
    """Write ``folder`` (config.json + safetensors, saved by transformers) as GGUF at ``out``."""
    d = json.loads((folder / "config.json").read_text())
    kind = d["model_type"]
    arch = ARCH_OF[kind]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, kind, d, extras)
    w.add_file_type(FILE_TYPE[qtype])
    hf = {}
    for f in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(f))
    names = gguf.get_tensor_name_map(arch, d["num_hidden_layers"])
    for name, t in _tensors(kind, d, hf, names, extras):
        _add(w, name, t.float().numpy(), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---- metadata -------------------------------------------------------------------------------


def _rope_parameters(d: dict) -> dict:
    """TextModel.__init__: rope_parameters (or rope_scaling), with top-level thetas mirrored in."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if d.get("rope_local_base_freq") is not None:
            rope["sliding_attention"] = {"rope_theta": d["rope_local_base_freq"]}
        if "rope_theta" not in rope and d.get("rope_theta") is not None:
            rope["rope_theta"] = d["rope_theta"]
    return rope


def _generic(w: gguf.GGUFWriter, d: dict) -> None:
    """TextModel.set_gguf_parameters: the keys every architecture built on it writes."""
    w.add_block_count(d["num_hidden_layers"])
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    if d.get("num_key_value_heads") is not None:
        w.add_head_count_kv(d["num_key_value_heads"])
    rope = _rope_parameters(d)
    params = rope.get("full_attention", rope)
    kind = params.get("rope_type")
    if kind == "linear" and params.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    elif kind not in (None, "default"):
        raise NotImplementedError(f"rope_type {kind!r}: not needed by these tests")
    if params.get("rope_theta") is not None:
        w.add_rope_freq_base(params["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is not None:
        w.add_expert_count(experts)
    if d.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(d["num_experts_per_tok"])
    if d.get("head_dim") is not None:
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])


def _metadata(w: gguf.GGUFWriter, kind: str, d: dict, extras: bool) -> None:
    n_heads, head_dim = d["num_attention_heads"], d.get("head_dim")
    if kind in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"):
        _generic(w, d)
    if kind in ("llama", "mistral"):  # LlamaModel
        w.add_vocab_size(d["vocab_size"])
        w.add_rope_dimension_count(head_dim or d["hidden_size"] // n_heads)
        if extras and kind == "mistral" and d.get("sliding_window"):  # EXTRA: dropped by llama.cpp
            w.add_sliding_window(d["sliding_window"])
    elif kind == "qwen3_moe":  # Qwen2MoeModel
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        if extras and not d.get("norm_topk_prob", False):  # EXTRA: llama.cpp always renormalises
            w.add_expert_weights_norm(False)
    elif kind == "phi3":  # Phi3MiniModel: a key set of its own
        w.add_context_length(d["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(d["original_max_position_embeddings"])
        w.add_embedding_length(d["hidden_size"])
        w.add_feed_forward_length(d["intermediate_size"])
        w.add_block_count(d["num_hidden_layers"])
        w.add_head_count(n_heads)
        w.add_head_count_kv(d["num_key_value_heads"])
        w.add_layer_norm_rms_eps(d["rms_norm_eps"])
        w.add_rope_dimension_count(d["hidden_size"] // n_heads)
        w.add_rope_freq_base(_rope_parameters(d)["rope_theta"])
        w.add_sliding_window(d.get("sliding_window") or 0)
        if (d.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise NotImplementedError("Phi-3's longrope factors: not needed by these tests")
    elif kind == "gemma2":  # Gemma2Model: no RoPE base
        w.add_context_length(d["max_position_embeddings"])
        w.add_embedding_length(d["hidden_size"])
        w.add_block_count(d["num_hidden_layers"])
        w.add_feed_forward_length(d["intermediate_size"])
        w.add_head_count(n_heads)
        w.add_head_count_kv(d.get("num_key_value_heads", n_heads))
        w.add_layer_norm_rms_eps(d["rms_norm_eps"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(d["attn_logit_softcapping"])
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
        w.add_sliding_window(d["sliding_window"])
    elif kind == "gemma3_text":  # Gemma3Model, beyond the generic keys (which it restates)
        assert d.get("attn_logit_softcapping") is None
        if d.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(d["final_logit_softcapping"])
        if d.get("sliding_window_pattern", d.get("_sliding_window_pattern")) != 1:
            w.add_sliding_window(d["sliding_window"])
    # SpecialVocab reads the special token ids from config.json too
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(d.get(key), int):
            add(d[key])


# ---- tensors --------------------------------------------------------------------------------


def _tensors(kind: str, d: dict, hf: dict, names, extras: bool):
    """(GGUF name, tensor) pairs: each architecture's changes, then the name map."""
    n_heads, n_kv = d["num_attention_heads"], d.get("num_key_value_heads", d["num_attention_heads"])
    experts: dict[int, dict] = defaultdict(dict)
    for name, t in hf.items():
        if kind.startswith("gemma"):
            if name == "lm_head.weight":
                continue  # "lm_head is not used in llama.cpp"
            if name.endswith("norm.weight"):
                t = t.float() + 1  # Gemma's RMSNorm multiplies by (1 + w)
        if kind in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_heads if name.endswith("q_proj.weight") else n_kv
            t = torch.from_numpy(hf_to_gguf_permute(t.float().numpy(), heads))
        if ".mlp.experts." in name:  # stacked once a layer's experts are all there
            layer = int(name.split(".")[2])
            experts[layer][name] = t
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None and extras and kind == "qwen3_moe" and ".mlp." in name:
            layer, proj = name.split(".")[2], name.split(".")[-2]  # EXTRA: a dense layer
            new = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}.weight"
        if new is None:
            raise ValueError(f"Can not map tensor {name!r}")  # what llama.cpp's converter says
        yield new, t
    E = d.get("num_local_experts", d.get("num_experts"))
    for layer, parts in sorted(experts.items()):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            stacked = torch.stack(
                [parts[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(E)]
            )
            merged = f"model.layers.{layer}.mlp.experts.{proj}.weight"
            yield names.get_name(merged, try_suffixes=(".weight",)), stacked


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: T) -> None:
    t = qtype
    if data.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        t = T.F32
    try:
        q = gguf.quants.quantize(data, t)
    except gguf.QuantError:  # "falling back to F16"
        t = T.F16
        q = gguf.quants.quantize(data, t)
    w.add_tensor(name, q, raw_dtype=t)
