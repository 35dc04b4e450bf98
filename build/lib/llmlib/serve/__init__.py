"""The OpenAI-compatible server (chapter 11): the batching engine behind HTTP.

* :mod:`~llmlib.serve.protocol` — request bodies checked and turned into engine requests;
* :mod:`~llmlib.serve.client` — the engine as the server sees it;
* :mod:`~llmlib.serve.app` — the FastAPI app and its SSE streams;
* :mod:`~llmlib.serve.launch` — ``llmlib serve`` and :class:`ServerThread`.
"""

from llmlib.serve.app import create_app
from llmlib.serve.client import EngineClient
from llmlib.serve.launch import ServerThread, build_engine
from llmlib.serve.protocol import APIError, Limits

__all__ = ["APIError", "EngineClient", "Limits", "ServerThread", "build_engine", "create_app"]
