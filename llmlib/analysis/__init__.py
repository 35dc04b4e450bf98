"""Arithmetic about models and machines: what a model costs, what a machine can do.

* :mod:`~llmlib.analysis.gpus` — datasheets of real accelerators;
* :mod:`~llmlib.analysis.costs` — parameters, bytes, FLOPs and decode floors from a config;
* :mod:`~llmlib.analysis.capacity` — what fits in a GPU's memory, and the KV cache it leaves;
* :mod:`~llmlib.analysis.roofline` — the roofline model, and this machine's two ceilings measured;
* :mod:`~llmlib.analysis.invariance` — how far temperature 0 is from reproducible in the engine.
"""
