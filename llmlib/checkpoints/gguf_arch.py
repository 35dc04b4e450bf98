"""GGUF architectures: what each one's metadata means, and where each of its tensors goes.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes each Hugging Face family under an
architecture of its own, and changes some tensors on the way; this module is the table of both, so
that a GGUF file reads into the same :class:`~llmlib.config.ModelConfig` and the same state dict
as the folder it was converted from:

============  ============  ====================================================================
GGUF arch     family        what the converter did, and what reading undoes
============  ============  ====================================================================
``llama``     llama,        rows of W_q and W_k permuted head by head for llama.cpp's interleaved
              mistral,      RoPE (un-permuted on reading); Mistral and Mixtral are written as
              mixtral       ``llama`` too: a window or experts in the metadata say which it is
``qwen2``     qwen2         nothing (llama.cpp rotates split halves, "NEOX", as Hugging Face does)
``qwen3``     qwen3         nothing
``qwen3moe``  qwen3_moe     experts stacked per layer, ``ffn_{gate,up,down}_exps`` ``[E, out,
                            in]`` (split per expert); the router is ``ffn_gate_inp``
``phi3``      phi3          ``qkv_proj`` kept fused as ``attn_qkv``, ``gate_up_proj`` as
                            ``ffn_up`` of 2F rows: both split by rows, as from the folder
``gemma2``    gemma2        every RMSNorm gain written as ``1 + w`` (the converter adds Gemma's
                            offset; 1 is subtracted again, so ``norm_offset`` stays 1 as in the
                            folder); ``lm_head`` dropped (the head is the embedding)
``gemma3``    gemma3_text   as Gemma 2, the q/k norms included
============  ============  ====================================================================

Where the metadata is silent, llmlib assumes what llama.cpp assumes for that architecture, which is
what the real models are:

* Mistral's window: the converter drops ``sliding_window`` for ``llama`` and llama.cpp attends over
  everything; a ``llama.attention.sliding_window`` key, where a file has one, is read as a window
  on every layer (Mistral's own semantics).
* Phi-3 writes its window (0 for none); llama.cpp ignores it, llmlib applies it on every layer, as
  the folder's model does.
* Qwen2, Qwen3 and Qwen3-MoE: no window is written (``use_sliding_window``, off in the published
  models), and none is read: the file attends over everything, as llama.cpp does.
* Gemma: windows alternate with a fixed period (2 for Gemma 2: local first; 6 for Gemma 3: five
  local, one global), Gemma 2's window is 4096 and its caps 50 and 30 unless written, the local
  RoPE base of Gemma 3 is 10 000 unless ``rope.freq_base_swa`` says otherwise. The score scale is
  not written (``query_pre_attn_scalar``): it is ``1/sqrt(head_dim)``, or ``1/sqrt(d_model /
  n_heads)`` for the 27B models (46 and 62 layers), llama.cpp's rule, which is what the published
  configs hold.
* Qwen3-MoE: llama.cpp always renormalises the top-k router weights (``norm_topk_prob``) unless
  ``expert_weights_norm`` says otherwise, and expects every layer routed; a layer stored with a
  dense ``ffn_gate``/``ffn_up``/``ffn_down`` instead is read as a dense layer.
* Gemma 3's ``final_logit_softcapping``, when written, is applied (as the folder's model does;
  llama.cpp does not read it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from llmlib.families import FULL, SLIDING

#: GGUF tensor names (after ``blk.N.``) and their llmlib names (after ``layers.N.``).
TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.wq",
    "attn_k": "attn.wk",
    "attn_v": "attn.wv",
    "attn_output": "attn.wo",
    "ffn_norm": "ffn_norm",  # Gemma: the norm before the FFN (pre_feedforward_layernorm)
    "ffn_gate": "ffn.w_gate",
    "ffn_up": "ffn.w_up",
    "ffn_down": "ffn.w_down",
    "ffn_gate_inp": "ffn.router",  # mixture of experts: the router
    "attn_q_norm": "attn.q_norm",  # Qwen3, Gemma 3: per-head RMSNorm gains
    "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "attn_post_norm",  # Gemma: the norms on each sub-layer's output
    "post_ffw_norm": "ffn_post_norm",
}
#: Model-level tensors.
GLOBAL_NAMES: dict[str, str] = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
#: Mixture-of-experts weights stored as one 3-D tensor per layer: [n_experts, out, in].
MERGED_EXPERTS: dict[str, str] = {
    "ffn_gate_exps": "w_gate",
    "ffn_up_exps": "w_up",
    "ffn_down_exps": "w_down",
}
#: Tensors llama.cpp keeps fused, and the llmlib tensors their rows split into, in order.
FUSED: dict[str, tuple[str, ...]] = {"attn_qkv": ("attn.wq", "attn.wk", "attn.wv")}

_GEMMA = dict(scale_embeddings=True, norm_offset=1.0, post_norms=True, activation="gelu_tanh")


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture: its family, its fixed ModelConfig fields, the converter's changes."""

    family: str
    fields: dict = field(default_factory=dict)
    permuted_qk: bool = False  # W_q, W_k rows permuted for interleaved RoPE
    norms_plus_one: bool = False  # RMSNorm gains stored as 1 + w
    fused: dict = field(default_factory=dict)  # beyond FUSED: kind -> llmlib tensors


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", permuted_qk=True),
    "qwen2": Arch("qwen2", {"qkv_bias": True}),
    "qwen3": Arch("qwen3", {"qk_norm": True}),
    "qwen3moe": Arch("qwen3_moe", {"qk_norm": True}),
    "phi3": Arch("phi3", fused={"ffn_up": ("ffn.w_gate", "ffn.w_up")}),
    "gemma2": Arch("gemma2", _GEMMA, norms_plus_one=True),
    "gemma3": Arch("gemma3_text", _GEMMA | {"qk_norm": True}, norms_plus_one=True),
}


def f32_to_float(x: object) -> float:
    """A float32 metadata value as the decimal its authors wrote (1e-5 is stored as
    9.99999974e-06; the shortest decimal that rounds to the same float32 recovers it)."""
    return float(str(np.float32(x)))


# ---- metadata -> ModelConfig fields ---------------------------------------------------------


def family_fields(meta: dict, arch: str, tensors: dict, shape: dict[str, int]) -> dict[str, object]:
    """The family fields of a ``<arch>`` file's config (see the module docstring).

    ``shape`` holds the config's ``n_layers``, ``head_dim``, ``d_model`` and ``n_heads``;
    ``tensors`` the file's tensor table (a MoE layer is one with a router).
    """
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    a = ARCHITECTURES[arch]
    out: dict[str, object] = {"family": a.family, **a.fields}
    n = shape["n_layers"]
    window = get("attention.sliding_window")
    if int(get("expert_count", 0) or 0):
        out["expert_ffn_dim"] = int(get("expert_feed_forward_length", 0) or 0)
        out["dense_layers"] = tuple(
            i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        )
        norm = get("expert_weights_norm")
        out["norm_topk_prob"] = True if norm is None else bool(norm)
        if arch == "llama":
            out["family"] = "mixtral"
    if arch in ("llama", "phi3") and window:  # every layer slides
        out["sliding_window"] = int(window)
        if arch == "llama" and out["family"] == "llama":
            out["family"] = "mistral"
    if a.norms_plus_one:
        out.update(_gemma(arch, get, window, shape))
    return out


def _gemma(arch: str, get, window: object, shape: dict[str, int]) -> dict[str, object]:
    n, gemma2 = shape["n_layers"], arch == "gemma2"
    if window is None and not gemma2:
        raise ValueError(
            f"GGUF metadata is missing the required field '{arch}.attention.sliding_window'"
        )
    period = 2 if gemma2 else 6
    big = n == (46 if gemma2 else 62)  # the 27B models: llama.cpp scales by d_model / n_heads
    scalar = shape["d_model"] // shape["n_heads"] if big else shape["head_dim"]
    out: dict[str, object] = dict(
        sliding_window=int(4096 if window is None else window),
        layer_types=tuple(SLIDING if i % period < period - 1 else FULL for i in range(n)),
        attn_scale=float(scalar) ** -0.5,
    )
    if gemma2:
        out["attn_softcap"] = f32_to_float(get("attn_logit_softcapping", 50.0))
        out["final_softcap"] = f32_to_float(get("final_logit_softcapping", 30.0))
    else:
        cap = get("final_logit_softcapping")
        out["final_softcap"] = None if not cap else f32_to_float(cap)
        out["rope_local_theta"] = f32_to_float(get("rope.freq_base_swa", 10_000.0))
    return out


# ---- tensors --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Where one llmlib tensor lies in a GGUF tensor: the whole of it, or ``expert`` (an index on
    its first dimension) and ``rows`` (a range of rows after that), rows permuted head by head for
    ``heads`` heads (llama's q and k), values stored plus ``shift`` (Gemma's norm gains)."""

    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    heads: int | None = None
    shift: float = 0.0

    def source(self, gguf_name: str) -> str:
        """The GGUF tensor and the part of it, for messages: ``blk.0.attn_qkv.weight[0:64]``."""
        idx = [] if self.expert is None else [str(self.expert)]
        if self.rows is not None:
            idx.append(f"{self.rows[0]}:{self.rows[1]}")
        return gguf_name + (f"[{', '.join(idx)}]" if idx else "")


_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+?)(?:\.(\d+))?\.(weight|bias)$")
_BIASED = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv")  # what a bias may belong to


def tensor_parts(cfg, arch: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
    """The llmlib tensors GGUF tensor ``name`` (of torch ``shape``) holds; None for a name llmlib
    does not know. A fused tensor whose rows do not add up is a ValueError naming it."""
    a = ARCHITECTURES[arch]
    shift = 1.0 if a.norms_plus_one and name.removesuffix(".weight").endswith("norm") else 0.0
    stem = name.removesuffix(".weight")
    if name.endswith(".weight") and stem in GLOBAL_NAMES:
        return [Part(GLOBAL_NAMES[stem] + ".weight", shift=shift)]
    m = _BLOCK.match(name)
    if not m:
        return None
    layer, kind, expert, suffix = m.groups()
    p = f"layers.{layer}."
    if suffix == "bias" and (kind not in _BIASED or expert is not None):
        return None
    if expert is not None:  # an older layout: one tensor per expert
        if kind not in ("ffn_gate", "ffn_up", "ffn_down"):
            return None
        return [Part(f"{p}ffn.experts.{expert}.{TENSOR_NAMES[kind].split('.')[1]}.weight")]
    if kind in MERGED_EXPERTS:
        ours = MERGED_EXPERTS[kind]
        return [Part(f"{p}ffn.experts.{e}.{ours}.weight", expert=e) for e in range(shape[0])]
    if kind == "ffn_gate_up_exps":  # gate and up of every expert, [E, 2F, D]
        F = _check_rows(name, shape[1], [cfg.expert_dim] * 2)[0]
        return [
            Part(f"{p}ffn.experts.{e}.{w}.weight", expert=e, rows=r)
            for e in range(shape[0])
            for w, r in (("w_gate", (0, F)), ("w_up", (F, 2 * F)))
        ]
    fused = a.fused.get(kind) or FUSED.get(kind)
    if fused:
        rows = _check_rows(name, shape[0], _fused_rows(cfg, kind))
        parts, r0 = [], 0
        for ours, r in zip(fused, rows):
            heads = _heads(cfg, a, ours) if suffix == "weight" else None
            parts.append(Part(f"{p}{ours}.{suffix}", rows=(r0, r0 + r), heads=heads))
            r0 += r
        return parts
    if kind not in TENSOR_NAMES:
        return None
    ours = TENSOR_NAMES[kind]
    heads = _heads(cfg, a, ours) if suffix == "weight" and len(shape) == 2 else None
    return [Part(f"{p}{ours}.{suffix}", heads=heads, shift=shift)]


def _heads(cfg, a: Arch, ours: str) -> int | None:
    if not a.permuted_qk:
        return None
    return {"attn.wq": cfg.n_heads, "attn.wk": cfg.n_kv_heads}.get(ours)


def _fused_rows(cfg, kind: str) -> list[int]:
    if kind == "attn_qkv":
        return [cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2
    return [cfg.ffn_dim, cfg.ffn_dim]  # Phi-3's ffn_up: gate, then up


def _check_rows(name: str, n: int, rows: list[int]) -> list[int]:
    if n != sum(rows):
        raise ValueError(
            f"{name} has {n} rows, expected {sum(rows)} ({' + '.join(map(str, rows))}) "
            "from the metadata"
        )
    return rows


def in_family(cfg, ours: str) -> bool:
    """Whether a tensor llmlib knows belongs to this config (a bias only where it has them ...)."""
    if ours.endswith(".bias"):
        return cfg.out_bias if ".attn.wo." in ours else cfg.qkv_bias
    if ".q_norm." in ours or ".k_norm." in ours:
        return cfg.qk_norm
    if "_post_norm." in ours:
        return cfg.post_norms
    return True


def gguf_name(llmlib_key: str) -> str:
    """The GGUF name a llmlib parameter has in a plain file (for messages about a tensor that is
    missing): the inverse of :func:`tensor_parts` for unfused tensors."""
    suffix = ".bias" if llmlib_key.endswith(".bias") else ".weight"
    key = llmlib_key.removesuffix(suffix)
    for g, ours in GLOBAL_NAMES.items():
        if key == ours:
            return g + ".weight"
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m:
        layer, rest = m.groups()
        e = re.match(r"^ffn\.experts\.(\d+)\.(w_gate|w_up|w_down)$", rest)
        if e:
            kind = {v: k for k, v in MERGED_EXPERTS.items()}[e.group(2)]
            return f"blk.{layer}.{kind}.weight[{e.group(1)}]"
        for g, ours in TENSOR_NAMES.items():
            if rest == ours:
                return f"blk.{layer}.{g}{suffix}"
    return llmlib_key
