"""The batching engine (chapter 10): continuous batching over a paged KV cache.

* :mod:`~llmlib.engine.sequence` — one request as the scheduler sees it;
* :mod:`~llmlib.engine.block_manager` — which KV blocks each sequence owns, and prefix sharing;
* :mod:`~llmlib.engine.scheduler` — which sequences run in the next step, and how many tokens each;
* :mod:`~llmlib.engine.paged_cache` — the block pools, and the cache view of one forward pass;
* :mod:`~llmlib.engine.config` — :class:`EngineConfig`, everything the engine runs with, resolved once;
* :mod:`~llmlib.engine.fixed_step` — the fixed-shape step (CUDA graphs on a GPU, compiled on a CPU);
* :mod:`~llmlib.engine.run_mode` — how the steps run, chosen in one place;
* :mod:`~llmlib.engine.runner` — a step's chunks through the model, and sampling;
* :mod:`~llmlib.engine.outputs` — what the engine reports;
* :mod:`~llmlib.engine.request` — a request's choices, their text and log-probabilities;
* :mod:`~llmlib.engine.llm` — :class:`LLM`, requests in and text out;
* :mod:`~llmlib.engine.async_llm` — :class:`AsyncLLM`, the engine in a thread, for servers.
"""

from llmlib.engine.async_llm import AsyncLLM, QueueFull, RequestStream
from llmlib.engine.config import EngineConfig
from llmlib.engine.llm import LLM
from llmlib.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "QueueFull",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "TokenLogprob",
]
