"""Lazy re-exports for package ``__init__`` files: a name's module is imported on first use.

``import llmlib`` and ``import llmlib.gguf_file`` (which the tokenizer needs to read a
GGUF file's vocabulary) then stay fast and torch-free until a model is actually asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, resolving ``name -> module`` on first access."""
    namespace = importlib.import_module(package).__dict__

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
