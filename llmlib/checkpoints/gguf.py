"""Read a llama.cpp GGUF checkpoint: its config from the metadata, its weights dequantized.

A GGUF file is one self-describing binary: a header of typed key/value metadata (the model's
shape, its tokenizer, its chat template) followed by a table of tensors and their raw bytes,
aligned so the whole file can be memory-mapped. :mod:`llmlib.gguf_file` parses that container (it
memory-maps the file and never unpickles anything; it is checked against the ``gguf`` package's
``GGUFReader`` in the tests, and parses a large vocabulary far sooner than it); the numbers
themselves are decoded by :mod:`llmlib.checkpoints.quant`, our own dequantizer.

Three things differ from a Hugging Face checkpoint, and :func:`read_gguf` undoes each:

* names: ``blk.3.attn_q.weight`` becomes ``layers.3.attn.wq.weight`` (see
  :data:`~llmlib.checkpoints.gguf_arch.TENSOR_NAMES`);
* dimension order: the header lists dimensions fastest-first (``ne[0]`` is the row length), the
  reverse of numpy and torch, so a ``[576, 1536]`` GGUF tensor is a ``[1536, 576]`` torch matrix;
* rotary layout: llama.cpp rotates *adjacent* pairs (0,1), (2,3), ... of each head of a
  ``llama`` model, while Hugging Face checkpoints (and llmlib) rotate element ``i`` with
  ``i + head_dim/2``. The converter therefore permutes the rows of ``W_q`` and ``W_k`` head by head;
  we permute them back (:func:`unpermute_qk`), which is what makes the logits equal to
  ``transformers``. Every other architecture read here rotates split halves in llama.cpp too (its
  "NEOX" mode) and the converter leaves the rows alone, so there is nothing to undo.

The architectures (``llama`` with Mistral and Mixtral, ``qwen2``, ``qwen3``, ``qwen3moe``,
``phi3``, ``gemma2``, ``gemma3``), what each one's metadata says and what its converter changes
(fused tensors, Gemma's norm gains stored as ``1 + w``) are the table of
:mod:`llmlib.checkpoints.gguf_arch`; every tensor reads through its list of
:class:`~llmlib.checkpoints.gguf_arch.Part`, here and in the lazy reader
(:mod:`llmlib.checkpoints.lazy`) alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmlib.checkpoints.gguf_arch import (  # the names tables and gguf_name: re-exported
    ARCHITECTURES,
    GLOBAL_NAMES,  # noqa: F401
    MERGED_EXPERTS,  # noqa: F401
    TENSOR_NAMES,  # noqa: F401
    Part,
    f32_to_float,
    family_fields,
    gguf_name,  # noqa: F401
    in_family,
    tensor_parts,
)
from llmlib.checkpoints.quant import block_format, dequantize
from llmlib.config import ModelConfig, RopeScaling
from llmlib.gguf_file import GGUFFile, GGUFFormatError, TensorInfo
from llmlib.model.rope import interleaved_to_split_half_perm, permute_heads

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
#: Architectures whose converter permutes the rows of W_q and W_k for interleaved RoPE.
PERMUTED_QK = tuple(a for a, arch in ARCHITECTURES.items() if arch.permuted_qk)


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
    if int(_get(reader, p + "attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{p}attention.value_length differs from key_length; llmlib needs one")
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

    theta = f32_to_float(_get(reader, p + "rope.freq_base", 10_000.0))
    rope_scaling = None
    scaling_type = _get(reader, p + "rope.scaling.type")
    if scaling_type not in (None, "none", "linear"):
        raise ValueError(f"{p}rope.scaling.type {scaling_type!r} is not supported")
    factor = f32_to_float(_get(reader, p + "rope.scaling.factor", 1.0))
    if scaling_type == "linear" and factor != 1.0:  # every frequency divided (Gemma 3's global)
        rope_scaling = RopeScaling(factor=factor, rope_type="linear")
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise ValueError("rope_freqs.weight and a linear rope.scaling.factor: one scaling only")
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

    n_layers = int(_get(reader, p + "block_count", required=True))
    shape = dict(n_layers=n_layers, head_dim=head_dim, d_model=d_model, n_heads=n_heads)
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn_dim=int(_get(reader, p + "feed_forward_length", required=True)),
        head_dim=head_dim,
        max_seq_len=int(_get(reader, p + "context_length", 8192)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=f32_to_float(_get(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        n_experts=int(_get(reader, p + "expert_count", 0) or 0),
        n_experts_per_token=int(_get(reader, p + "expert_used_count", 0) or 0),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        **family_fields(reader.metadata, arch, tensors, shape),  # type: ignore[arg-type]
    )


# ---- tensors ----------------------------------------------------------------------------------


def take(w: torch.Tensor, part: Part) -> torch.Tensor:
    """``part`` of a GGUF tensor read whole (floats, or the raw rows of a block-quantized matrix):
    its expert, its rows, un-permuted, less its shift."""
    if part.expert is not None:
        w = w[part.expert]
    if part.rows is not None:
        w = w[part.rows[0] : part.rows[1]]
    if part.heads is not None:
        w = unpermute_qk(w, part.heads)
    return w - part.shift if part.shift else w


def read_gguf(
    path: str | Path,
    progress: bool | None = None,
    blocks: dict | None = None,
    sources: dict | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file of any architecture in :data:`SUPPORTED_ARCHITECTURES` into
    ``(config, state_dict)``, float32.

    The state dict uses llmlib's parameter names (see :class:`llmlib.model.Transformer`) and holds
    what the Hugging Face folder would: query and key projections back in split-half rotary
    layout, fused tensors split, Gemma's norm gains without the 1 the converter added. Errors name
    the offending field or tensor: an unknown architecture or quantization type, a missing, extra
    or mis-shaped tensor, and a truncated file are all ValueErrors. ``progress=None`` shows a
    progress bar only for files over a gigabyte (a small model decodes in a second or two).

    ``blocks``, a dict, receives the raw bytes of every block-quantized matrix as
    ``{llmlib name: (type name, uint8 tensor [rows, bytes per row])}``, rows in the same order as
    the float tensor (q and k un-permuted): what ``quantization="gguf"`` repacks without
    re-quantizing (:mod:`llmlib.checkpoints.repack`). ``sources`` receives, per llmlib name, the
    GGUF tensor it came from (and the part of it), for messages.
    """
    path = Path(path)
    reader = open_gguf(path)
    if progress is None:
        progress = path.stat().st_size > 1 << 30
    cfg = config_from_gguf(reader, name=path.stem)
    arch = reader.architecture

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
        shape = _tensor_shape(t)
        parts = tensor_parts(cfg, arch, t.name, shape)
        if parts is None or not all(in_family(cfg, q.name) for q in parts):
            extra.append(t.name)
            continue
        try:
            # ValueError on a short buffer
            w = dequantize(reader.raw(t.name), t.ggml_type, shape, t.name)
        except (TypeError, IndexError, OSError) as e:  # a memory map cut short by a truncated file
            raise ValueError(
                f"{t.name}: cannot read its data ({e}); the file is truncated or corrupt"
            ) from e
        raw = None
        fmt = block_format(t.ggml_type, t.name)
        if blocks is not None and fmt.block_size > 1 and w.ndim == 2:
            raw = torch.from_numpy(np.array(reader.raw(t.name), dtype=np.uint8))
            raw = raw.view(shape[0], -1)
        for q in parts:
            state[q.name] = take(w, q).contiguous()
            if raw is not None:
                blocks[q.name] = (fmt.name, take(raw, q).contiguous())
            if sources is not None:
                sources[q.name] = q.source(t.name)

    if extra:
        raise ValueError(
            f"{path.name}: unexpected tensor(s) llmlib does not know: {', '.join(extra[:5])}"
        )
    return cfg, state  # names and shapes are checked once, against the shape table, by build_model
