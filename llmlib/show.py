"""Helpers for the book's notebooks: show llmlib's real source, and a consistent figure style.

The chapters never paste code: they call :func:`show_source` on the package's own objects, so the
rendered book cannot drift from what ``import llmlib`` runs.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

#: The running example: every core chapter follows this one question a step further (its tokens,
#: its vectors, its positions, its attention, its residual stream, its next token, its cache, its
#: decode step on the roofline, its place in a batch, its answer from the server).
QUESTION = "What is a quadratic equation?"


def source_of(obj: Any) -> str:
    """The source text of a function, class or module, dedented."""
    return textwrap.dedent(inspect.getsource(obj))


def show_source(*objs: Any, title: str | None = None, max_lines: int = 40) -> Any:
    """Render the source of one or more llmlib objects as highlighted Python blocks.

    A listing shows the first ``max_lines`` lines of each object, the idea a chapter teaches; the
    rest (the branches a reader can skip on a first pass) is folded under a line to open.
    Returns an IPython ``Markdown`` object (displayed by Jupyter); outside IPython, the text.
    """
    blocks = []
    for obj in objs:
        where = getattr(inspect.getmodule(obj), "__name__", "?")
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
        header = f"# {where}.{name}" if name and where != name else f"# {where}"
        lines = source_of(obj).rstrip().splitlines()
        cut = _fold_at(lines, max_lines)
        block = "```python\n" + header + "\n" + "\n".join(lines[:cut]) + "\n```"
        if len(lines) > cut:
            rest = "\n".join(lines[cut:])
            block += (
                f"\n\n<details><summary>the other {len(lines) - cut} lines of "
                f"<code>{name or where}</code></summary>\n\n```python\n{rest}\n```\n\n</details>"
            )
        blocks.append(block)
    md = (f"**{title}**\n\n" if title else "") + "\n\n".join(blocks)
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover - plain Python
        return md
    return Markdown(md)


def _fold_at(lines: list[str], max_lines: int) -> int:
    """Where to fold a listing: at most ``max_lines`` lines in, never inside a string of several
    lines (each half must read as Python on its own)."""
    if len(lines) <= max_lines:
        return len(lines)
    cut = max_lines
    while cut > 1 and sum(x.count('"""') + x.count("'''") for x in lines[:cut]) % 2:
        cut -= 1
    return cut


def recorded(
    path: str | Path,
    rows: list[dict[str, Any]],
    columns: dict[str, str] | None = None,
    title: str = "Recorded on other machines",
) -> Any:
    """A record from ``results/`` as a collapsed table, under a line naming its machine and date.

    A chapter's prose speaks only of the reader's own run; figures measured elsewhere (another CPU
    class, a GPU, a peer engine) stay in their record and appear folded, with where they came
    from, so a reader never takes them for their own machine's. ``rows`` are computed by the
    caller from the record (``json.loads(Path(path).read_text())``); ``columns`` maps a row's key
    to its header (all keys of the first row when omitted). Floats print with 3 significant
    digits, or as whole numbers from 100 up.
    """
    path = Path(path)
    rec = json.loads(path.read_text())
    machine = rec.get("machine", {}) if isinstance(rec, dict) else {}
    if not machine and isinstance(rec, dict):  # a record of several runs: the first one's
        machine = next(
            (v["machine"] for v in rec.values() if isinstance(v, dict) and "machine" in v), {}
        )
    cpu = machine.get("device_name") or machine.get("cpu") or rec.get("cpu", "")
    date = str(machine.get("date") or rec.get("date", ""))[:10]
    columns = columns or {k: k for k in (rows[0] if rows else {})}

    def cell(v: Any) -> str:
        if isinstance(v, float):  # 3 significant digits, never in e-notation
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    table = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(cell(r.get(k, "")) for k in columns) + " |" for r in rows]
    where = ", ".join(x for x in (cpu, date) if x)
    md = (
        f"<details><summary>{title}: <code>{path.as_posix().lstrip('./')}</code>"
        f"{f' ({where})' if where else ''}</summary>\n\n" + "\n".join(table) + "\n\n</details>"
    )
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover - plain Python
        return md
    return Markdown(md)


class _Shown:
    """Mixed into a number or a string: its ``repr`` is the value written as the prose quotes it."""

    _spec = ""

    def __repr__(self) -> str:
        return format(self._base(self), self._spec)

    def __str__(self) -> str:  # print() and f-strings see the plain value
        return self._base.__str__(self) if self._base is str else self._base.__repr__(self)

    @property
    def _base(self) -> type:
        return type(self).__mro__[2]  # int, float or str

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text/plain
        p.text(repr(self))


class _ShownInt(_Shown, int):
    pass


class _ShownFloat(_Shown, float):
    pass


class _ShownStr(_Shown, str):
    pass


def shown(value: Any, spec: str = "") -> Any:
    """A value the prose quotes, formatted by ``spec`` (``",.0f"``, ``".1%"``, ...).

    A chapter's text cites its own run: ``layers_gb = shown(x / 1e9, ".1f")`` in a code cell, and
    ``{eval}`layers_gb``` in the markdown below it. The book's build and JupyterLab (with
    jupyterlab-myst) both show such a name as its value, which they take from its ``repr``: here
    the formatted number, without quotes. The value still computes as the int, float or string it
    was (``shown(2.5, ".0f") * 2 == 5.0``); a 0-d tensor or numpy scalar becomes a Python number.
    """
    if hasattr(value, "item") and not isinstance(value, (int, float, str)):
        value = value.item()
    if isinstance(value, (str, bool)):
        out: Any = _ShownStr(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        out = _ShownInt(value)
    elif isinstance(value, (int, float)):
        out = _ShownFloat(value)
    else:
        raise TypeError(f"shown() takes a number or a string, not {type(value).__name__}")
    out._spec = spec
    return out


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
