"""The OpenAI-compatible server (chapter 11): the batching engine behind HTTP.

* :mod:`~llmlib.serve.protocol` — the request bodies as pydantic models, and the errors;
* :mod:`~llmlib.serve.prepare` — a validated body turned into prompt ids and sampling params;
* :mod:`~llmlib.serve.client` — the engine as the server sees it;
* :mod:`~llmlib.serve.render` — engine outputs as response bodies and stream chunks;
* :mod:`~llmlib.serve.metrics` — ``/metrics`` in Prometheus' format;
* :mod:`~llmlib.serve.app` — the FastAPI app and its SSE streams;
* :mod:`~llmlib.serve.launch` — ``llmlib serve`` and :class:`ServerThread`.
"""

from llmlib.serve.app import create_app
from llmlib.serve.client import EngineClient
from llmlib.serve.launch import ServerThread, build_engine
from llmlib.serve.protocol import APIError, Limits

__all__ = ["APIError", "EngineClient", "Limits", "ServerThread", "build_engine", "create_app"]
