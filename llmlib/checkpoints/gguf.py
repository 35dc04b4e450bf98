"""Read a llama.cpp GGUF checkpoint: its config from the metadata, its weights dequantized.

A GGUF file is one self-describing binary: a header of typed key/value metadata (the model's
shape, its tokenizer, its chat template) followed by a table of tensors and their raw bytes,
aligned so the whole file can be memory-mapped. :mod:`llmlib.gguf_file` parses that container (it
memory-maps the file and never unpickles anything; it is checked against the ``gguf`` package's
``GGUFReader`` in the tests, and parses a large vocabulary far sooner than it); the numbers
themselves are decoded by :mod:`llmlib.checkpoints.quant`, our own dequantizer.

Three things differ from a Hugging Face checkpoint, and :func:`read_gguf` undoes each:

* names: ``blk.3.attn_q.weight`` becomes ``layers.3.attn.wq.weight`` (see :data:`TENSOR_NAMES`);
* dimension order: the header lists dimensions fastest-first (``ne[0]`` is the row length), the
  reverse of numpy and torch, so a ``[576, 1536]`` GGUF tensor is a ``[1536, 576]`` torch matrix;
* rotary layout: llama.cpp rotates *adjacent* pairs (0,1), (2,3), ... of each head of a
  ``llama`` model, while Hugging Face checkpoints (and llmlib) rotate element ``i`` with
  ``i + head_dim/2``. The converter therefore permutes the rows of ``W_q`` and ``W_k`` head by head;
  we permute them back (:func:`unpermute_qk`), which is what makes the logits equal to
  ``transformers``. For ``qwen2`` and ``qwen3`` llama.cpp rotates split halves (its "NEOX" mode)
  and the converter leaves the rows alone, so there is nothing to undo.

Besides ``llama``, the ``qwen2`` (q, k, v biases) and ``qwen3`` (per-head q/k norms)
architectures are read: their metadata says everything the model needs (:data:`ARCH_FIELDS`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from llmlib.checkpoints.quant import block_format, dequantize
from llmlib.config import ModelConfig, RopeScaling
from llmlib.gguf_file import GGUFFile, GGUFFormatError, TensorInfo
from llmlib.model.rope import interleaved_to_split_half_perm, permute_heads

#: GGUF tensor names (after ``blk.N.``) and their llmlib names (after ``layers.N.``).
TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.wq",
    "attn_k": "attn.wk",
    "attn_v": "attn.wv",
    "attn_output": "attn.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn.w_gate",
    "ffn_up": "ffn.w_up",
    "ffn_down": "ffn.w_down",
    "ffn_gate_inp": "ffn.router",  # mixture of experts: the router
    "attn_q_norm": "attn.q_norm",  # Qwen3: per-head RMSNorm gains
    "attn_k_norm": "attn.k_norm",
}
#: Model-level tensors.
GLOBAL_NAMES: dict[str, str] = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
#: Mixture-of-experts weights stored as one 3-D tensor per layer: [n_experts, out, in].
MERGED_EXPERTS: dict[str, str] = {
    "ffn_gate_exps": "w_gate",
    "ffn_up_exps": "w_up",
    "ffn_down_exps": "w_down",
}

#: Per GGUF architecture, the family fields its metadata implies (see :mod:`llmlib.families`).
ARCH_FIELDS: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen2": {"family": "qwen2", "qkv_bias": True},
    "qwen3": {"family": "qwen3", "qk_norm": True},
}
SUPPORTED_ARCHITECTURES = tuple(ARCH_FIELDS)
#: Architectures whose converter permutes the rows of W_q and W_k for interleaved RoPE.
PERMUTED_QK = ("llama",)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a query or key projection ``[n_heads * hd, D]``.

    llama.cpp rotates adjacent pairs; llmlib rotates split halves. Chapter 4's
    :func:`llmlib.model.rope.permute_heads` with :func:`llmlib.model.rope.interleaved_to_split_half_perm`
    turns one layout into the other, head by head. (For keys, ``n_heads`` is the number of KV heads.)
    """
    hd = w.shape[0] // n_heads
    return permute_heads(w, n_heads, interleaved_to_split_half_perm(hd))


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The forward permutation (llmlib's layout -> llama.cpp's), the inverse of :func:`unpermute_qk`:
    what a converter writing a GGUF file does."""
    hd = w.shape[0] // n_heads
    return permute_heads(w, n_heads, torch.argsort(interleaved_to_split_half_perm(hd)))


# ---- metadata ---------------------------------------------------------------------------------


def open_gguf(path: str | Path) -> GGUFFile:
    """Memory-map a GGUF file and read its header; a truncated or foreign file is a clear ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFFile(path)
    except GGUFFormatError as e:
        raise ValueError(
            f"cannot parse as GGUF: {e}; the file is truncated, corrupt, or not GGUF"
        ) from e


def metadata(reader: GGUFFile, skip_arrays: bool = True) -> dict[str, object]:
    """The key/value header as plain Python values (long arrays such as the vocabulary skipped)."""
    out: dict[str, object] = {}
    for key, value in reader.metadata.items():
        if skip_arrays and isinstance(value, list) and len(value) > 64:
            out[key] = f"<array of {len(value)}>"
        else:
            out[key] = value
    return out


def _get(reader: GGUFFile, key: str, default: object = None, required: bool = False) -> object:
    if key not in reader.metadata:
        if required:
            raise ValueError(f"GGUF metadata is missing the required field {key!r}")
        return default
    return reader.metadata[key]


def _f32_to_float(x: object) -> float:
    # Metadata floats are float32: 1e-5 is stored as 9.99999974e-06. The shortest decimal that
    # rounds to the same float32 recovers the value the model's authors wrote.
    return float(str(np.float32(x)))


def _tensor_shape(t: TensorInfo) -> tuple[int, ...]:
    """The torch shape of a tensor (the reader has already reversed GGUF's fastest-first dims)."""
    return tuple(t.shape)


def _rope_scaling_from_freqs(
    freqs: torch.Tensor, theta: float, head_dim: int, name: str
) -> RopeScaling:
    """Recover Llama-3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor (per-frequency divisors).

    llama.cpp stores the scaling as one divisor per frequency rather than as four numbers. We try
    the published Llama-3 parameters with the largest divisor as ``factor`` and check that they
    reproduce every divisor; anything else is refused rather than guessed.
    """
    factor = float(freqs.max())
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    for orig in (8192,):
        rs = RopeScaling(
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=orig,
        )
        wavelen = 2 * torch.pi / inv
        low_wl, high_wl = orig / rs.low_freq_factor, orig / rs.high_freq_factor
        smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        div = torch.where(
            wavelen > low_wl,
            torch.full_like(inv, factor),
            torch.where(
                wavelen < high_wl, torch.ones_like(inv), 1.0 / ((1 - smooth) / factor + smooth)
            ),
        )
        if freqs.numel() == div.numel() and torch.allclose(freqs.double(), div, rtol=1e-3):
            return rs
    raise ValueError(
        f"{name}: rope frequency factors do not match Llama-3 scaling; unsupported rope_freqs"
    )


def config_from_gguf(reader: GGUFFile, name: str = "gguf") -> ModelConfig:
    """Build a :class:`ModelConfig` from the ``<arch>.*`` and ``tokenizer.ggml.*`` metadata."""
    arch = _get(reader, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"general.architecture is {arch!r}; llmlib reads only {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    p = f"{arch}."
    d_model = int(_get(reader, p + "embedding_length", required=True))
    n_heads = int(_get(reader, p + "attention.head_count", required=True))
    n_kv = int(_get(reader, p + "attention.head_count_kv", n_heads))
    head_dim = int(_get(reader, p + "attention.key_length", d_model // n_heads))
    rot = int(_get(reader, p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(
            f"{p}rope.dimension_count is {rot} but head_dim is {head_dim}; partial rotary is not supported"
        )

    tensors = reader.tensors
    vocab = _get(reader, p + "vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.metadata:
        vocab = len(reader.metadata["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in tensors:
        vocab = _tensor_shape(tensors["token_embd.weight"])[0]
    if vocab is None:
        raise ValueError(
            "cannot tell the vocabulary size: no llama.vocab_size, tokenizer.ggml.tokens or token_embd.weight"
        )

    theta = _f32_to_float(_get(reader, p + "rope.freq_base", 10_000.0))
    rope_scaling = None
    scaling_type = _get(reader, p + "rope.scaling.type")
    if scaling_type not in (None, "none", "linear") or (
        scaling_type == "linear" and _get(reader, p + "rope.scaling.factor", 1.0) != 1.0
    ):
        raise ValueError(f"{p}rope.scaling.type {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        freqs = dequantize(reader.raw(t.name), t.ggml_type, _tensor_shape(t), t.name)
        rope_scaling = _rope_scaling_from_freqs(freqs, theta, head_dim, t.name)

    eos_ids: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        v = _get(reader, key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = _get(reader, "tokenizer.ggml.bos_token_id")

    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(_get(reader, p + "block_count", required=True)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn_dim=int(_get(reader, p + "feed_forward_length", required=True)),
        head_dim=head_dim,
        max_seq_len=int(_get(reader, p + "context_length", 8192)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=_f32_to_float(_get(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        n_experts=int(_get(reader, p + "expert_count", 0) or 0),
        n_experts_per_token=int(_get(reader, p + "expert_used_count", 0) or 0),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        **ARCH_FIELDS[arch],  # type: ignore[arg-type]
    )


# ---- tensors ----------------------------------------------------------------------------------

_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+?)(?:\.(\d+))?\.(weight|bias)$")
_BIASED = ("attn_q", "attn_k", "attn_v", "attn_output")  # the tensors a bias may belong to


def llmlib_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to llmlib's parameter name (None for names llmlib does not know).

    Merged expert tensors (``ffn_gate_exps``) map to the prefix ``layers.N.ffn.experts.*.w_gate``;
    :func:`read_gguf` splits them per expert.
    """
    if gguf_name.endswith(".weight") and gguf_name[: -len(".weight")] in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name[: -len(".weight")]] + ".weight"
    m = _BLOCK.match(gguf_name)
    if not m:
        return None
    layer, kind, expert, suffix = m.groups()
    if suffix == "bias":
        return (
            f"layers.{layer}.{TENSOR_NAMES[kind]}.bias" if kind in _BIASED and not expert else None
        )
    if kind in MERGED_EXPERTS and expert is None:
        return f"layers.{layer}.ffn.experts.*.{MERGED_EXPERTS[kind]}.weight"
    if expert is not None and kind in ("ffn_gate", "ffn_up", "ffn_down"):  # older per-expert layout
        return f"layers.{layer}.ffn.experts.{expert}.{TENSOR_NAMES[kind].split('.')[1]}.weight"
    if expert is None and kind in TENSOR_NAMES:
        return f"layers.{layer}.{TENSOR_NAMES[kind]}.weight"
    return None


def gguf_name(llmlib_key: str) -> str:
    """The GGUF name a llmlib parameter comes from (for error messages): the inverse of :func:`llmlib_name`."""
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


def read_gguf(
    path: str | Path, progress: bool | None = None, blocks: dict | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a ``llama``, ``qwen2`` or ``qwen3`` GGUF file into ``(config, state_dict)``, float32.

    The state dict uses llmlib's parameter names (see :class:`llmlib.model.Transformer`), with the
    query and key projections back in Hugging Face's split-half rotary layout. Errors name the
    offending field or tensor: an unknown architecture or quantization type, a missing, extra or
    mis-shaped tensor, and a truncated file are all ValueErrors. ``progress=None`` shows a progress
    bar only for files over a gigabyte (a small model decodes in a second or two).

    ``blocks``, a dict, receives the raw bytes of every block-quantized matrix as
    ``{llmlib name: (type name, uint8 tensor [rows, bytes per row])}``, rows in the same order as
    the float tensor (q and k un-permuted): what ``quantization="gguf"`` repacks without
    re-quantizing (:mod:`llmlib.checkpoints.repack`).
    """
    path = Path(path)
    reader = open_gguf(path)
    if progress is None:
        progress = path.stat().st_size > 1 << 30
    cfg = config_from_gguf(reader, name=path.stem)

    # Check the whole table before decoding anything: a bad file fails fast, with a name.
    for t in reader.tensors.values():
        block_format(t.ggml_type, t.name)  # unknown quantization type -> ValueError
    state: dict[str, torch.Tensor] = {}
    extra: list[str] = []
    tensors = list(reader.tensors.values())
    if progress:
        from tqdm import tqdm  # plain tqdm: tqdm.auto warns in notebooks without ipywidgets

        tensors = tqdm(tensors, desc=f"reading {path.name}", unit="tensor", leave=False)
    for t in tensors:
        if t.name == "rope_freqs.weight":
            continue  # already folded into cfg.rope_scaling
        ours = llmlib_name(t.name)
        if ours is None or not _in_family(cfg, ours):
            extra.append(t.name)
            continue
        shape = _tensor_shape(t)
        try:
            # ValueError on a short buffer
            w = dequantize(reader.raw(t.name), t.ggml_type, shape, t.name)
        except (TypeError, IndexError, OSError) as e:  # a memory map cut short by a truncated file
            raise ValueError(
                f"{t.name}: cannot read its data ({e}); the file is truncated or corrupt"
            ) from e
        if ".experts.*." in ours:  # one [E, out, in] tensor -> E matrices
            for e in range(w.shape[0]):
                state[ours.replace("*", str(e))] = w[e]
            continue
        raw = None
        fmt = block_format(t.ggml_type, t.name)
        if blocks is not None and fmt.block_size > 1 and w.ndim == 2:
            raw = torch.from_numpy(np.array(reader.raw(t.name), dtype=np.uint8))
            raw = raw.view(shape[0], -1)
        permuted = reader.metadata["general.architecture"] in PERMUTED_QK
        if permuted and ours.endswith("attn.wq.weight") and w.ndim == 2:
            w = unpermute_qk(w, cfg.n_heads)
            raw = None if raw is None else unpermute_qk(raw, cfg.n_heads)
        elif permuted and ours.endswith("attn.wk.weight") and w.ndim == 2:
            w = unpermute_qk(w, cfg.n_kv_heads)
            raw = None if raw is None else unpermute_qk(raw, cfg.n_kv_heads)
        state[ours] = w.contiguous()
        if raw is not None:
            blocks[ours] = (fmt.name, raw.contiguous())

    if extra:
        raise ValueError(
            f"{path.name}: unexpected tensor(s) llmlib does not know: {', '.join(extra[:5])}"
        )
    return cfg, state  # names and shapes are checked once, against the shape table, by build_model


def _in_family(cfg: ModelConfig, ours: str) -> bool:
    """Whether a tensor llmlib knows belongs to this architecture (a bias only where it has them)."""
    if ours.endswith(".bias"):
        return cfg.out_bias if ".attn.wo." in ours else cfg.qkv_bias
    if ".q_norm." in ours or ".k_norm." in ours:
        return cfg.qk_norm
    return True
