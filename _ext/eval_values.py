"""Keep what each ``{eval}`` role showed in the executed notebook, as JupyterLab reads it.

The book quotes its own run in the prose with MyST's ``{eval}`name``` role: the build (myst-nb, in
``inline`` execution mode) asks the running kernel for each name as it reaches it. jupyterlab-myst
renders the same role from a markdown cell's ``user_expressions`` metadata, which it fills when a
reader runs the cell. This extension writes that metadata into the executed notebooks the build
leaves in ``_build/jupyter_execute``, so those notebooks open in JupyterLab with their numbers in
place (tests/test_book_lab.py opens them there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import myst_nb.ext.eval as _eval
from myst_nb.core.render import MditRenderMixin

EVAL = re.compile(r"\{eval\}`([^`]+)`")
_shown: dict[str, list[tuple[str, Any]]] = {}
_retrieve = _eval.retrieve_eval_data


def _render_markdown(self: Any, token: Any) -> None:
    """A markdown cell that quotes values runs after every cell above it, as in JupyterLab's "run
    all": myst-nb runs a cell only when it renders its outputs, which a removed cell never does."""
    index = token.meta["index"]
    client = self.nb_client
    if index and EVAL.search("".join(client.notebook.cells[index].source)):
        client.code_cell_outputs(index - 1)
    _render_markdown_cell(self, token)


_render_markdown_cell = MditRenderMixin.render_nb_cell_markdown


def _retrieve_and_keep(document: Any, key: str) -> Any:
    data = _retrieve(document, key)
    docname = document.settings.env.docname
    _shown.setdefault(docname, []).append((key, data))
    return data


def _user_expressions(app: Any, doctree: Any) -> None:
    docname = app.env.docname
    shown = _shown.pop(docname, [])
    if not shown:
        return
    path = Path(app.env.mystnb_config.output_folder, *f"{docname}.ipynb".split("/"))
    nb = json.loads(path.read_text(encoding="utf8"))
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        names = EVAL.findall("".join(cell["source"]))
        if not names:
            continue
        results = []
        for name in names:
            key, outputs = shown.pop(0)
            assert key == name, f"{docname}: {{eval}} roles out of order ({key} for {name})"
            out = outputs[0]
            results.append(
                {
                    "expression": name,
                    "result": {"status": "ok", "data": out.data, "metadata": out.metadata},
                }
            )
        cell["metadata"]["user_expressions"] = results
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf8")


def setup(app: Any) -> dict[str, Any]:
    _eval.retrieve_eval_data = _retrieve_and_keep
    MditRenderMixin.render_nb_cell_markdown = _render_markdown
    app.connect("doctree-read", _user_expressions)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
