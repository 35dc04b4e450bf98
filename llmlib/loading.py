"""Reading real checkpoints into :class:`llmlib.model.Transformer`.

Two sources:

* a Hugging Face folder: ``config.json`` plus ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``. Llama-family (Llama 2/3, SmolLM2, Mistral) and Mixtral names are
  mapped to llmlib's (:func:`hf_to_llmlib`);
* a ``.gguf`` file, read by :func:`llmlib.gguf.read_gguf` (which dequantizes and undoes llama.cpp's
  Q/K permutation, so it hands back the same names and layout).

Loading is strict: every tensor the config implies must be present with the right shape, and every
tensor in the file must have a place to go. A mistake is a ``ValueError`` naming the tensor or
field, never a model with some weights silently left at random. Only ``safetensors`` and ``gguf``
are read: never pickle.

The model is first built on PyTorch's ``meta`` device (shapes, no memory, no random init), then
allocated on the target device and filled from the checkpoint.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from llmlib.config import ModelConfig
from llmlib.linear import pack_weights
from llmlib.model import Transformer, expected_shapes

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device_dtype(device: str | torch.device | None = None,
                         dtype: str | torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """Defaults: CUDA when there is one, else CPU; bfloat16 on CUDA, float32 on CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return device, dtype


def load_model(path: str | Path, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> Transformer:
    """Load a Hugging Face folder or a ``.gguf`` file as a :class:`Transformer` in eval mode."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.suffix == ".gguf":
        from llmlib.gguf import read_gguf

        cfg, state = read_gguf(path)
    elif path.is_dir():
        cfg, state = read_hf_folder(path)
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a folder with config.json and safetensors")
    return build_model(cfg, state, device, dtype)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None) -> Transformer:
    """Check ``state`` (llmlib names) against ``cfg`` and return a model holding exactly those weights."""
    device, dtype = resolve_device_dtype(device, dtype)
    check_state_dict(cfg, state)
    model = Transformer(cfg, device="meta")
    # Hand the checkpoint's own tensors to the model (assign=True) instead of allocating and copying:
    # on this kind of machine first-touching half a gigabyte of fresh memory costs seconds.
    # The pre-load hooks concatenate q/k/v and gate/up into their fused matrices on the way in.
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rope.reset(device)  # the cos/sin tables are derived from the config, never loaded
    model.requires_grad_(False)  # an inference library: no autograd bookkeeping on the weights
    if device.type == "cpu":
        use_matvec_layout(model)  # batch-1 decode: matrix-vector products stream these
        pack_weights(model)  # batches: oneDNN's blocked copy (llmlib.linear), after the layout is final
    return model.eval()


def matvec_layout_is_column_major(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a ``[out, in]`` weight multiplies one vector faster stored column-major on a CPU.

    A decode step is a matrix-vector product per weight, limited by how fast the weights stream from
    memory. MKL streams long contiguous runs best: measured on this project's 2-core machine,
    [3072, 576] (gate/up) reaches ~19 GB/s column-major against ~12 row-major, the [49152, 576] LM head
    ~22 against ~12, while [576, 1536] (down) is the other way round, ~16 row-major against ~12.
    So: make the longer dimension the contiguous one (ties: column-major, slightly faster for wo).
    """
    out_features, in_features = shape
    return out_features >= in_features


def _in_matvec_layout(p: torch.Tensor) -> bool:
    if matvec_layout_is_column_major(p.shape):
        return p.stride() == (1, p.shape[0])
    return p.is_contiguous()


_HUGE_PAGE = 2 << 20  # bytes in an x86-64 transparent huge page


def _advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask Linux to back ``[ptr, ptr + nbytes)`` (2 MiB aligned, not yet touched) with huge pages."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or nbytes < _HUGE_PAGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ptr, nbytes, 14) == 0  # 14 = MADV_HUGEPAGE
    except (OSError, AttributeError):
        return False


def use_matvec_layout(model: torch.nn.Module, huge_pages: bool = True) -> int:
    """Re-store the weight matrices for fast decoding on a CPU; return how many were moved.

    Two things make a batch-1 decode step (one matrix-vector product per weight, limited by how
    fast the weights stream from memory) faster, with the same names, shapes and values:

    * each matrix gets its faster layout (:func:`matvec_layout_is_column_major`);
    * all matrices move into one buffer, in the order a forward pass reads them, that Linux is
      asked to back with 2 MiB pages instead of 4 KiB ones (``madvise(MADV_HUGEPAGE)``): a step
      touches ~0.5 GB, i.e. ~130,000 small pages and as many TLB misses; with huge pages, 260.
      Measured here: the matrix products of a SmolLM2 step drop from ~29 to ~27 ms.

    ``state_dict()`` still hands out contiguous tensors that own their memory
    (:class:`llmlib.model.Transformer` copies the others), so saving with safetensors works.
    A second call returns 0. Weights that are not on the CPU only get their layout changed.
    """
    mats = [p for p in model.parameters() if p.dim() == 2]
    if not mats or all(_in_matvec_layout(p) for p in mats):
        return 0
    dtypes = {p.dtype for p in mats}
    on_cpu = all(p.device.type == "cpu" for p in mats)
    with torch.no_grad():
        if not (on_cpu and len(dtypes) == 1):
            for p in mats:
                if not _in_matvec_layout(p):
                    p.data = p.data.t().contiguous().t() if matvec_layout_is_column_major(p.shape) else p.data.contiguous()
            return len(mats)
        dtype = mats[0].dtype
        elt = torch.empty((), dtype=dtype).element_size()
        step = 64 // elt  # start every matrix on a cache line
        sizes = [-(-p.numel() // step) * step for p in mats]
        total = sum(sizes)
        pad = _HUGE_PAGE // elt
        arena = torch.empty(total + pad, dtype=dtype)  # untouched memory: pages are allocated on first write
        ptr = arena.data_ptr()
        aligned = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
        if huge_pages:
            _advise_huge_pages(aligned, (total * elt) // _HUGE_PAGE * _HUGE_PAGE)
        offset = (aligned - ptr) // elt
        for p, size in zip(mats, sizes):
            out_f, in_f = p.shape
            chunk = arena[offset : offset + p.numel()]
            new = chunk.view(in_f, out_f).t() if matvec_layout_is_column_major(p.shape) else chunk.view(out_f, in_f)
            new.copy_(p.data)
            p.data = new
            offset += size
    return len(mats)


def check_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first missing, extra, misshapen or non-float tensor."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more} required by the config")
    extra = [k for k in state if k not in want]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r}{more}: no place for it in this config")
    for k, shape in want.items():
        t = state[k]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {k!r} has shape {tuple(t.shape)} but the config implies {shape} "
                             f"(d_model={cfg.d_model}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
                             f"head_dim={cfg.head_dim}, ffn_dim={cfg.ffn_dim}, vocab_size={cfg.vocab_size})")
        if not t.dtype.is_floating_point:
            raise ValueError(f"tensor {k!r} has dtype {t.dtype}; expected floating point weights")


# ---- Hugging Face folders --------------------------------------------------------------------

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
    # ... and as transformers 5 may name the router
    "mlp.gate.weight": "ffn.router.weight",
}
_EXPERT_NAMES = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight")
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq")  # derived buffers that old checkpoints saved


def hf_to_llmlib(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Llama/Mixtral Hugging Face state dict to llmlib's names.

    Also splits transformers-5 stacked expert tensors (``mlp.experts.gate_up_proj [E, 2F, D]``,
    ``mlp.experts.down_proj [E, D, F]``) into one tensor per expert. Raises on any name it does not
    know, so a checkpoint of a different architecture (biases, extra norms) cannot half-load.
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
            i, rest = m.group(1), m.group(2)
            p = f"layers.{i}."
            if rest in _LAYER_NAMES:
                out[p + _LAYER_NAMES[rest]] = t
                continue
            e = _EXPERT_RE.fullmatch(rest)
            if e:
                out[f"{p}ffn.experts.{e.group(1)}.{_EXPERT_NAMES[e.group(2)]}.weight"] = t
                continue
            if rest == "mlp.experts.gate_up_proj":
                if t.dim() != 3 or t.shape[1] != 2 * cfg.ffn_dim:
                    raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected [n_experts, 2*{cfg.ffn_dim}, d_model]")
                for j in range(t.shape[0]):
                    out[f"{p}ffn.experts.{j}.w_gate.weight"] = t[j, : cfg.ffn_dim]
                    out[f"{p}ffn.experts.{j}.w_up.weight"] = t[j, cfg.ffn_dim :]
                continue
            if rest == "mlp.experts.down_proj":
                if t.dim() != 3:
                    raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected [n_experts, d_model, ffn_dim]")
                for j in range(t.shape[0]):
                    out[f"{p}ffn.experts.{j}.w_down.weight"] = t[j]
                continue
        raise ValueError(f"checkpoint has unexpected tensor {name!r}: not part of a Llama/Mixtral model")
    if cfg.tie_embeddings and "lm_head.weight" in out:
        # Some tied checkpoints store the shared matrix twice. A copy is harmless; a different matrix
        # means the config is wrong about tying, and silently dropping it would change the model.
        if "embed.weight" in out and out["lm_head.weight"].shape == out["embed.weight"].shape and \
                torch.equal(out["lm_head.weight"], out["embed.weight"]):
            del out["lm_head.weight"]
        else:
            raise ValueError("checkpoint has tensor 'lm_head.weight' that differs from the embeddings, "
                             "but config.json says tie_word_embeddings=true")
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
        raise ValueError(f"cannot read safetensors file {file} (truncated or corrupt?): {e}") from None


def read_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (llmlib names) of a Hugging Face model folder."""
    folder = Path(folder)
    cfg = read_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    hf_state: dict[str, torch.Tensor] = {}
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"shard {shard} listed in {index.name} is missing from {folder}")
            tensors = read_safetensors(folder / shard)
            for name in tensors:
                if weight_map.get(name) != shard:
                    raise ValueError(f"tensor {name!r} found in {shard} but {index.name} does not list it there")
            hf_state.update(tensors)
        absent = [n for n in weight_map if n not in hf_state]
        if absent:
            raise ValueError(f"tensor {absent[0]!r} is listed in {index.name} but absent from {weight_map[absent[0]]}")
    elif single.is_file():
        hf_state = read_safetensors(single)
    else:
        found = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json (found {found}); "
                                "pickle checkpoints (*.bin, *.pt) are deliberately not supported")
    return cfg, hf_to_llmlib(cfg, hf_state)
