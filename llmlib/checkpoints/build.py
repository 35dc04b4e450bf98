"""From a checkpoint on disk to a :class:`llmlib.model.Transformer` holding exactly its weights.

:func:`load_model` is the one door: it reads the file with the reader for its kind (a Hugging Face
folder, :mod:`llmlib.checkpoints.hf`; a ``.gguf`` file, :mod:`llmlib.checkpoints.gguf`), each of
which hands back a config and a state dict in llmlib's names, and :func:`build_model` checks that
state dict against the one shape table (:func:`llmlib.shapes.param_shapes`) before the model sees
it. A mistake is a ``ValueError`` naming the tensor (in the checkpoint's own naming where the reader
gives one) or the field, never a model with some weights silently left at random. Only
``safetensors`` and ``gguf`` are read: never pickle.

The model is first built on PyTorch's ``meta`` device (shapes, no memory, no random init). Its
small tensors (norms, biases) are then read in; each weight matrix is read from the file only
when :func:`llmlib.kernels.prepare.prepare` stores it, straight into its final layout (a GGUF
file's blocks as codes, never as floats first), one matrix at a time: loading a model costs
about what the loaded model holds, however big the file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmlib.checkpoints import packed
from llmlib.checkpoints.lazy import LazyTensor, materialize, read_checkpoint_lazy
from llmlib.config import ModelConfig
from llmlib.device import choose
from llmlib.dtypes import QUANTIZATIONS
from llmlib.kernels.prepare import Format, Rows, prepare, weight_matrices
from llmlib.model import Transformer
from llmlib.shapes import param_shapes


def read_checkpoint(
    path: str | Path, blocks: dict | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Callable[[str], str]]:
    """``(config, state dict in llmlib's names, llmlib name -> the checkpoint's name)`` of a file or folder.

    ``blocks`` (a dict) receives a GGUF file's block-quantized matrices as they are stored.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.suffix == ".gguf":
        from llmlib.checkpoints.gguf import gguf_name, read_gguf

        sources: dict[str, str] = {}
        cfg, state = read_gguf(path, blocks=blocks, sources=sources)
        return cfg, state, lambda k: f"{k} (GGUF {sources.get(k) or gguf_name(k)})"
    if path.is_dir():
        from llmlib.checkpoints.hf import read_hf_folder

        cfg, state = read_hf_folder(path)
        return cfg, state, str
    raise ValueError(
        f"{path} is neither a .gguf file nor a folder with config.json and safetensors"
    )


def load_tokenizer_for(path: str | Path, required: bool = True) -> Any:
    """The tokenizer that goes with a model: the one inside a ``.gguf`` file, or a folder's
    ``tokenizer.json`` (or ``*.tiktoken``). ``required=False`` returns None for a folder or a
    file with weights only (the engine then takes prompts as token ids)."""
    from llmlib.tokenizer import load_tokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        try:
            return load_tokenizer(path)
        except ValueError as e:
            if required or "has no tokenizer" not in str(e):
                raise
            return None
    for cand in [path / "tokenizer.json", *sorted(path.glob("*.tiktoken"))]:
        if cand.exists():
            return load_tokenizer(cand)
    if required:
        raise FileNotFoundError(f"no tokenizer.json or *.tiktoken in {path}")
    return None


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    *,
    group_size: int = 32,
    progress: bool | None = None,
    plain: bool = False,
) -> Transformer:
    """Load a Hugging Face folder or a ``.gguf`` file as a :class:`Transformer` in eval mode.

    Defaults: CUDA and bfloat16 when a GPU is visible, else the CPU and float32
    (:func:`llmlib.device.choose`): the plain format the chapters compare against, where
    ``llmlib.LLM(path)`` and the ``llmlib`` commands pick the machine's fastest accurate format
    for their work (``weight_format`` says which each loaded). ``quantization``: ``None``
    (weights in ``dtype``), ``"int8"`` (one scale per output channel), ``"int4"``
    (``group_size`` weights per scale and zero point) or ``"gguf"`` (a GGUF file's own blocks
    as codes, :mod:`llmlib.checkpoints.repack`, never re-quantized); the weights are then held
    only in the packed layout, and ``dtype`` is the activations' (bfloat16 by default where the
    kernels are fast, :func:`llmlib.device.pick_dtype`).
    Each matrix is read from the file when it is packed, so the float weights of a quantized
    model never exist whole (``progress``: a bar per matrix, by default for files over a GB).
    ``plain=True`` keeps float matrices as ordinary ``nn.Linear`` weights (the model as the
    chapters build it) instead of this machine's fastest layouts.
    """
    path = Path(path).expanduser()
    if quantization == "gguf" and path.suffix != ".gguf":
        raise ValueError(
            f"{path.name}: quantization='gguf' repacks a .gguf file's blocks; this is not "
            "one (use 'int8' or 'int4')"
        )
    cfg, state, name_of = read_checkpoint_lazy(path)
    blocks = None
    if quantization == "gguf":
        from llmlib.checkpoints.lazy import lazy_gguf_blocks

        blocks = lazy_gguf_blocks(path, cfg)
        if not blocks:
            raise ValueError(
                f"{path.name}: quantization='gguf': the file stores no block-quantized matrix "
                "(its weights are float); load it without a quantization, or with 'int8'/'int4'"
            )
    if progress is None:
        progress = _size(path) > 1 << 30
    try:
        model = build_model(
            cfg,
            state,
            device,
            dtype,
            name_of=name_of,
            quantization=quantization,
            group_size=group_size,
            blocks=blocks,
            progress=progress,
            plain=plain,
            packed_from=path if quantization else None,
        )
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None
    model.source_path = path  # what a compiled step on disk is found by (llmlib.runtime.aot)
    return model


def _size(path: Path) -> int:
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def build_model(
    cfg: ModelConfig,
    state: dict[str, Any],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    name_of: Callable[[str], str] = str,
    quantization: str | None = None,
    group_size: int = 32,
    blocks: dict[str, Any] | None = None,
    progress: bool = False,
    plain: bool = False,
    packed_from: Path | None = None,
) -> Transformer:
    """Check ``state`` (llmlib names; tensors, or lazy ones read when needed) against ``cfg`` and
    return a model holding exactly those weights, each matrix stored for this machine
    (:func:`llmlib.kernels.prepare.prepare`). ``blocks`` maps a GGUF matrix's llmlib name to a
    reader of its raw blocks: with ``quantization="gguf"`` those matrices become codes.
    ``packed_from``: the file the weights come from, whose packed layouts are kept on disk after
    this load and mapped instead of packed at the next (:mod:`llmlib.checkpoints.packed`)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    place = choose(device, dtype, quantization)
    if quantization and not place.dtype.is_floating_point:
        raise ValueError(f"dtype {place.dtype} cannot hold activations")
    check_state_dict(cfg, state, name_of)
    model = Transformer(cfg, device="meta")
    matrices = weight_matrices(model)
    parts = {p for name in matrices for p in _parts(name)}
    if not cfg.tie_embeddings:
        parts.add("embed.weight")  # the table: prepare reads it (a GGUF file may keep codes)
    # The small tensors (norms, biases) now, on the target device and dtype; the pre-load hooks
    # concatenate q/k/v biases into the fused one on the way in.
    small = {
        k: materialize(v).to(device=place.device, dtype=place.dtype)
        for k, v in state.items()
        if k not in parts
    }
    model.load_state_dict(small, strict=False, assign=True)
    del small
    model.reset_rotary(place.device)  # the cos/sin tables come from the config, never loaded
    describe = _describe(name_of)

    def source(name: str) -> Any:
        kept = cache.weight(name) if cache is not None else None
        if kept is not None:
            return kept
        keys = _parts(name)
        if blocks is not None and all(k in blocks for k in keys):
            from llmlib.checkpoints.repack import block_codes, model_codes

            if len(keys) == 1 and blocks[keys[0]].heads is None:  # read a slice at a time
                b = blocks[keys[0]]
                shape = tuple(state[keys[0]].shape)
                return Rows(shape, lambda i, j: block_codes(b.kind, b.rows(i, j), keys[0]))
            codes = model_codes([name], {k: blocks[k]() for k in keys})
            if name in codes:
                return codes[name]
        if len(keys) == 1 and isinstance(state[keys[0]], LazyTensor):
            lazy = state[keys[0]]
            # float rows rounded here: small slices, since rounding one takes several times its bytes
            chunk = 1024 if quantization in ("int8", "int4") else 4096
            return Rows(tuple(lazy.shape), lambda i, j: lazy[i:j].load(), chunk)
        mats = [materialize(state[k]) for k in keys]
        return mats[0] if len(mats) == 1 else torch.cat(mats)

    fmt = Format(place.device, place.dtype, quantization, group_size, plain)
    cache = packed.open_packed(packed_from, fmt) if packed_from is not None else None
    prepare(model, fmt, source, describe=describe, progress=progress)
    if cache is not None:
        model.packed_weights = cache.path  # its buffers view the mapping, which they keep open
    elif packed_from is not None:
        kept = packed.keep(model, packed_from, fmt)
        if kept is not None and progress:
            print(f"llmlib: the packed weights are kept in {kept} for later starts", flush=True)
    model.requires_grad_(False)  # an inference library: no autograd bookkeeping on the weights
    return model.eval()


def _parts(module: str) -> list[str]:
    """The checkpoint tensors a weight matrix of the model is made of (q, k, v for ``wqkv``)."""
    from llmlib.checkpoints.repack import _parts as parts

    return [module + ".weight"] if module == "embed" else parts(module)


def _describe(name_of: Callable[[str], str]) -> Callable[[str], str]:
    """A fused matrix in the checkpoint's names of its parts (for error messages)."""

    def describe(key: str) -> str:
        return " + ".join(name_of(p) for p in _parts(key.removesuffix(".weight")))

    return describe


def check_state_dict(
    cfg: ModelConfig, state: dict[str, torch.Tensor], name_of: Callable[[str], str] = str
) -> None:
    """Raise ``ValueError`` naming the first missing, extra, misshapen or non-float tensor.

    ``name_of`` turns an llmlib name into what the checkpoint calls it, for the message.
    """
    want = param_shapes(cfg)
    missing = [k for k in want if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"checkpoint is missing tensor {name_of(missing[0])!r}{more} required by the config"
        )
    extra = [k for k in state if k not in want]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(
            f"checkpoint has unexpected tensor {extra[0]!r}{more}: no place for it in this config"
        )
    for k, shape in want.items():
        t = state[k]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"tensor {name_of(k)!r} has shape {tuple(t.shape)} but the config implies {shape} "
                f"(d_model={cfg.d_model}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
                f"head_dim={cfg.head_dim}, ffn_dim={cfg.ffn_dim}, vocab_size={cfg.vocab_size})"
            )
        if not t.dtype.is_floating_point:
            raise ValueError(
                f"tensor {name_of(k)!r} has dtype {t.dtype}; expected floating point weights"
            )
