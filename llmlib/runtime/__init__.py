"""How a step runs fast: CUDA graphs, ``torch.compile``, and compiled steps kept on disk.

* :mod:`~llmlib.runtime.graphs` — fixed-shape steps captured once and replayed as CUDA graphs;
* :mod:`~llmlib.runtime.compile` — how a step is compiled on each device;
* :mod:`~llmlib.runtime.aot` — compiled steps kept on disk, found by their key, loaded.

The step they serve is the engine's, the one fixed-shape step (:mod:`llmlib.engine.fixed_step`).
"""
