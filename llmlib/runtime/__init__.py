"""How a step runs fast: fixed-shape decode steps, CUDA graphs and ``torch.compile``.

* :mod:`~llmlib.runtime.static` — the fixed-shape KV cache of one request and its graphed step;
* :mod:`~llmlib.engine.graphs` — the batching engine's fixed-shape decode steps over the paged pool;
* :mod:`~llmlib.runtime.compile` — how a decode step is compiled on each device.
"""
