"""What :class:`llmlib.LLM` runs, from what it was given: a checkpoint path, or a loaded model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmlib.dtypes import torch_dtype
from llmlib.engine.config import EngineConfig


def load_engine_model(
    model: str | Path | torch.nn.Module, tokenizer: Any, config: EngineConfig
) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` in the format ``config`` names (its
    :meth:`~llmlib.engine.config.EngineConfig.with_format`). A path is loaded in it; a loaded
    model is moved and quantized only where asked, and a model that was built rather than loaded
    gets its matrices stored for this machine's kernels (:func:`llmlib.kernels.prepare.prepare`)."""
    if isinstance(model, (str, Path)):
        from llmlib.checkpoints import load_model, load_tokenizer_for

        path = Path(model)
        extra = {} if config.group_size is None else {"group_size": config.group_size}
        loaded = load_model(path, config.device, config.dtype, config.quantization, **extra)
        if tokenizer is None:
            tokenizer = load_tokenizer_for(path, required=False)
        return loaded, tokenizer
    if isinstance(model, torch.nn.Module):
        from llmlib.kernels.prepare import prepare, quantize_model

        device = config.device
        dtype = None if config.dtype is None else torch_dtype(config.dtype)
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        if config.quantization is not None:
            model = quantize_model(model, config.quantization)
        elif not hasattr(model, "weight_format"):
            prepare(model)
        return model, tokenizer
    raise TypeError(
        f"LLM: model must be a path or a loaded Transformer, got {type(model).__name__}"
    )
