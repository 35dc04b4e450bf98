"""What :class:`llmlib.LLM` runs, from what it was given: a checkpoint path, or a loaded model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_engine_model(
    model: str | Path | torch.nn.Module,
    tokenizer: Any,
    device: str | torch.device | None,
    dtype: torch.dtype | str | None,
    quantization: str | None,
) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` in the format asked for. A path with neither ``dtype`` nor
    ``quantization`` gets the fastest format whose perplexity stays within 1% of float32 on this
    machine, for batches (:func:`llmlib.device.choose_format`); a loaded model is moved and
    quantized only where asked, and a model that was built rather than loaded gets its matrices
    stored for this machine's kernels (:func:`llmlib.kernels.prepare.prepare`)."""
    if isinstance(model, (str, Path)):
        from llmlib.checkpoints import load_model, load_tokenizer_for
        from llmlib.device import choose_format

        path = Path(model)
        place, quantization = choose_format(
            device, dtype, quantization, gguf_blocks=path.suffix == ".gguf", batched=True
        )
        loaded = load_model(path, place.device, place.dtype, quantization)
        if tokenizer is None:
            tokenizer = load_tokenizer_for(path, required=False)
        return loaded, tokenizer
    if isinstance(model, torch.nn.Module):
        from llmlib.kernels.prepare import prepare, quantize_model

        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        if quantization is not None:
            model = quantize_model(model, quantization)
        elif not hasattr(model, "weight_format"):
            prepare(model)
        return model, tokenizer
    raise TypeError(
        f"LLM: model must be a path or a loaded Transformer, got {type(model).__name__}"
    )


def default_num_blocks(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int | None,
) -> int:
    """The KV pool's size when :class:`llmlib.LLM` is not given ``num_blocks``: ``kv_cache_bytes``
    worth, never more than ``max_num_seqs`` full-length sequences (plus one block each) could
    use. By default it is sized from the memory left once the weights are loaded: 80% of what is
    free on a GPU; on a CPU 1 GiB, or half of what the system has left if that is less (a big
    model on a small machine gets the pool that fits beside it, not an out-of-memory kill)."""
    from llmlib.device import free_memory
    from llmlib.shapes import kv_cache_bytes as kv_formula

    per_block = kv_formula(
        config.n_layers, config.n_kv_heads, config.head_dim, block_size, dtype.itemsize
    )
    if kv_cache_bytes is None:
        free = free_memory(device)
        if device.type == "cuda":
            kv_cache_bytes = int(free * 0.8)
        else:
            kv_cache_bytes = 1 << 30 if free is None else min(1 << 30, free // 2)
    needed = max_num_seqs * (-(-max_len // block_size) + 1)
    return max(1, min(needed, int(kv_cache_bytes // per_block)))
