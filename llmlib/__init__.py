"""llmlib: the inference path of a large language model, one stage per module.

The public names are imported lazily, so ``import llmlib`` stays fast and a reader who only
wants the tokenizer never pays for importing the model.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ModelConfig": "llmlib.config",
    "RopeScaling": "llmlib.config",
    "PRESETS": "llmlib.config",
    "get_config": "llmlib.config",
    "fetch_model": "llmlib.fetch",
    "default_model_path": "llmlib.fetch",
    "GPUS": "llmlib.costs",
    "train_bpe": "llmlib.tokenizer",
    "load_tokenizer": "llmlib.tokenizer",
    "Tokenizer": "llmlib.tokenizer",
    "Transformer": "llmlib.model",
    "load_model": "llmlib.loading",
    "Generator": "llmlib.generate",
    "LLM": "llmlib.engine",
    "SamplingParams": "llmlib.sampling",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
