"""The model: the book's stages as plain PyTorch modules, one file a stage.

* :mod:`~llmlib.model.embedding` — token ids to vectors, and the LM head back (chapter 3);
* :mod:`~llmlib.model.rope` — rotary positions (chapter 4);
* :mod:`~llmlib.model.attention` — attention, the cache contract, the layer (chapter 5);
* :mod:`~llmlib.model.norm` — RMSNorm (chapter 6);
* :mod:`~llmlib.model.block` — the block: norms, attention, the feed-forward network (chapter 6);
* :mod:`~llmlib.model.transformer` — :class:`Transformer`, the whole stack (chapter 6);
* :mod:`~llmlib.model.kv_cache` — the static KV cache (chapter 8).

Every module here calls its own submodules (``self.wqkv(x)``) and imports nothing from the
layers above (kernels, runtime, checkpoints, the engine): the machine's speed is swapped in
after the model is built (:func:`llmlib.kernels.prepare.prepare`).
"""

from llmlib._lazy import lazy_exports

_EXPORTS = {
    "Transformer": "llmlib.model.transformer",
    "random_model": "llmlib.model.transformer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
