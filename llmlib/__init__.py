"""llmlib: the inference path of a large language model, one stage per module.

The public names are imported lazily, so ``import llmlib`` stays fast and a reader who only
wants the tokenizer never pays for importing the model.
"""

from __future__ import annotations

from llmlib._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ModelConfig": "llmlib.config",
    "RopeScaling": "llmlib.config",
    "PRESETS": "llmlib.config",
    "get_config": "llmlib.config",
    "fetch_model": "llmlib.checkpoints",
    "default_model_path": "llmlib.checkpoints",
    "GPUS": "llmlib.analysis.gpus",
    "train_bpe": "llmlib.tokenizer",
    "load_tokenizer": "llmlib.tokenizer",
    "Tokenizer": "llmlib.tokenizer",
    "Transformer": "llmlib.model",
    "load_model": "llmlib.checkpoints",
    "Generator": "llmlib.generate",
    "LLM": "llmlib.engine",
    "EngineConfig": "llmlib.engine",
    "AsyncLLM": "llmlib.engine",
    "SamplingParams": "llmlib.sampling",
    "perplexity": "llmlib.perplexity",
    "SpeculativeConfig": "llmlib.speculative",
}

__all__ = sorted(_EXPORTS) + ["__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
