"""From a checkpoint on disk to a :class:`llmlib.model.Transformer` holding exactly its weights.

:func:`load_model` is the one door: it reads the file with the reader for its kind (a Hugging Face
folder, :mod:`llmlib.checkpoints.hf`; a ``.gguf`` file, :mod:`llmlib.checkpoints.gguf`), each of
which hands back a config and a state dict in llmlib's names, and :func:`build_model` checks that
state dict against the one shape table (:func:`llmlib.shapes.param_shapes`) before the model sees
it. A mistake is a ``ValueError`` naming the tensor (in the checkpoint's own naming where the reader
gives one) or the field, never a model with some weights silently left at random. Only
``safetensors`` and ``gguf`` are read: never pickle.

The model is first built on PyTorch's ``meta`` device (shapes, no memory, no random init), then
handed the checkpoint's tensors on the target device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmlib.config import ModelConfig
from llmlib.device import choose
from llmlib.dtypes import QUANTIZATIONS
from llmlib.kernels.linear import prepare_cpu_weights, use_matvec_layout
from llmlib.model import Transformer
from llmlib.quantize import quantize_model
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

        cfg, state = read_gguf(path, blocks=blocks)
        return cfg, state, lambda k: f"{k} (GGUF {gguf_name(k)})"
    if path.is_dir():
        from llmlib.checkpoints.hf import read_hf_folder

        cfg, state = read_hf_folder(path)
        return cfg, state, str
    raise ValueError(
        f"{path} is neither a .gguf file nor a folder with config.json and safetensors"
    )


def load_tokenizer_for(path: str | Path, required: bool = True) -> Any:
    """The tokenizer that goes with a model: the one inside a ``.gguf`` file, or a folder's
    ``tokenizer.json`` (or ``*.tiktoken``). ``required=False`` returns None for a folder with
    weights only (the engine then takes prompts as token ids)."""
    from llmlib.tokenizer import load_tokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        return load_tokenizer(path)
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
) -> Transformer:
    """Load a Hugging Face folder or a ``.gguf`` file as a :class:`Transformer` in eval mode.

    Defaults: CUDA and bfloat16 when a GPU is visible, else the CPU and float32
    (:func:`llmlib.device.choose`). ``quantization``: ``None`` (weights in ``dtype``), ``"int8"``
    (one scale per output channel), ``"int4"`` (``group_size`` weights per scale and zero point)
    or ``"gguf"`` (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, repacked:
    :mod:`llmlib.checkpoints.repack`); the weights are then held only in the packed layout
    (:mod:`llmlib.quantize`), and ``dtype`` is the activations' (bfloat16 by default where the
    kernels are fast, :func:`llmlib.device.pick_dtype`).
    """
    if quantization == "gguf" and Path(path).suffix != ".gguf":
        raise ValueError(
            f"{Path(path).name}: quantization='gguf' repacks a .gguf file's blocks; this is not "
            "one (use 'int8' or 'int4')"
        )
    blocks: dict | None = {} if quantization == "gguf" else None
    cfg, state, name_of = read_checkpoint(path, blocks=blocks)
    try:
        return build_model(
            cfg,
            state,
            device,
            dtype,
            name_of=name_of,
            quantization=quantization,
            group_size=group_size,
            blocks=blocks,
        )
    except ValueError as e:
        raise ValueError(f"{Path(path).name}: {e}") from None


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    name_of: Callable[[str], str] = str,
    quantization: str | None = None,
    group_size: int = 32,
    blocks: dict | None = None,
) -> Transformer:
    """Check ``state`` (llmlib names) against ``cfg`` and return a model holding exactly those weights
    (then, with ``quantization``, holding them packed: :func:`llmlib.quantize.quantize_model`)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    place = choose(device, dtype, quantization)
    if quantization and not place.dtype.is_floating_point:
        raise ValueError(f"dtype {place.dtype} cannot hold activations")
    check_state_dict(cfg, state, name_of)
    model = Transformer(cfg, device="meta")
    # Hand the checkpoint's own tensors to the model (assign=True) instead of allocating and copying:
    # on this kind of machine first-touching half a gigabyte of fresh memory costs seconds.
    # The pre-load hooks concatenate q/k/v and gate/up into their fused matrices on the way in.
    # A quantizer reads the checkpoint's own precision (codes from bfloat16-rounded weights would
    # differ from the float32 ones at every rounding boundary); the rest is cast after packing.
    load_dtype = torch.float32 if quantization else place.dtype
    state = {k: v.to(device=place.device, dtype=load_dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rotary(place.device)  # the cos/sin tables come from the config, never loaded
    model.requires_grad_(False)  # an inference library: no autograd bookkeeping on the weights
    if quantization is not None:
        codes = None
        if quantization == "gguf":
            from llmlib.checkpoints.repack import model_codes
            from llmlib.quantize import weight_matrices

            codes = model_codes(list(weight_matrices(model)), blocks or {})
            if not codes:
                raise ValueError("quantization='gguf': the file stores no Q4_0/Q4_1/Q8_0 matrix")
        del state
        quantize_model(
            model,
            quantization,
            group_size=group_size,
            codes=codes,
            describe=_describe(name_of),
            dtype=place.dtype,
        )
        for p in model.parameters():  # the norms and any matrix left dense (not the RoPE tables)
            p.data = p.data.to(place.dtype)
        model.weight_format = _format_name(model, quantization)
        use_matvec_layout(model)  # the matrices left dense (a gguf file's float ones)
        return model.eval()
    model.weight_format = str(place.dtype).removeprefix("torch.")
    prepare_cpu_weights(model)  # CPU only: decode and batch layouts (llmlib.kernels.linear)
    return model.eval()


def _describe(name_of: Callable[[str], str]) -> Callable[[str], str]:
    """A fused matrix in the checkpoint's names of its parts (for error messages)."""
    from llmlib.checkpoints.repack import _parts

    def describe(key: str) -> str:
        parts = _parts(key.removesuffix(".weight"))
        return " + ".join(name_of(p) for p in parts)

    return describe


def _format_name(model: Transformer, quantization: str) -> str:
    """``"gguf (int4 g32 x 210, int8 x 1) / bfloat16"``: what the weights are held in."""
    from collections import Counter

    from llmlib.quantize import PackedWeight, weight_matrices

    kinds: Counter[str] = Counter()
    for mod in weight_matrices(model).values():
        w = mod.weight
        if isinstance(w, PackedWeight):
            kinds[w.label] += 1
        else:
            kinds[str(w.dtype).removeprefix("torch.")] += 1
    inner = ", ".join(f"{k} x{n}" for k, n in kinds.most_common())
    return f"{quantization} ({inner}) / {str(model.dtype).removeprefix('torch.')}"


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
