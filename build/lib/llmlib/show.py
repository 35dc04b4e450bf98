"""Helpers for the book's notebooks: show llmlib's real source, and a consistent figure style.

The chapters never paste code: they call :func:`show_source` on the package's own objects, so the
rendered book cannot drift from what ``import llmlib`` runs.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def source_of(obj: Any) -> str:
    """The source text of a function, class or module, dedented."""
    return textwrap.dedent(inspect.getsource(obj))


def show_source(*objs: Any, title: str | None = None) -> Any:
    """Render the source of one or more llmlib objects as a highlighted Python block.

    Returns an IPython ``Markdown`` object (displayed by Jupyter); outside IPython, the text.
    """
    parts = []
    for obj in objs:
        where = getattr(inspect.getmodule(obj), "__name__", "?")
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
        header = f"# {where}.{name}" if name and where != name else f"# {where}"
        parts.append(header + "\n" + source_of(obj).rstrip())
    text = "\n\n".join(parts)
    md = (f"**{title}**\n\n" if title else "") + "```python\n" + text + "\n```"
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover - plain Python
        return md
    return Markdown(md)


def setup_plots() -> None:
    """One figure style for every chapter: readable at the book's width, no chart junk."""
    import matplotlib

    matplotlib.rcParams.update(
        {
            "figure.figsize": (7.5, 4.0),
            "figure.dpi": 110,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "font.size": 10,
            "axes.titlesize": 11,
            "legend.frameon": False,
        }
    )
