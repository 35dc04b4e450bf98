"""The book's sources: notebooks committed without outputs, every chapter in the table of contents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))


def test_there_are_chapters() -> None:
    assert NOTEBOOKS, "no chapters/*.ipynb found"
    assert NOTEBOOKS[0].name.startswith("01_")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(nb: Path) -> None:
    cells = json.loads(nb.read_text())["cells"]
    dirty = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not dirty, (
        f"{nb.name}: code cells {dirty} carry outputs or execution counts; strip them (the build executes notebooks)"
    )


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_numbered_title(nb: Path) -> None:
    cells = json.loads(nb.read_text())["cells"]
    first = "".join(cells[0]["source"]) if cells else ""
    if nb.name.startswith("g"):  # "Going further": numbered in a part of its own
        number = f"Going further {int(nb.name[1])}"
    else:
        number = str(int(nb.name[:2]))
    assert cells[0]["cell_type"] == "markdown" and re.match(rf"#\s+{number}\.\s+\S", first), (
        f"{nb.name} should open with a '# {number}. Title' markdown cell"
    )


def test_toc_lists_every_chapter() -> None:
    toc = (ROOT / "_toc.yml").read_text()
    listed = set(re.findall(r"chapters/((?:\d\d|g\d)_[a-z0-9_]+)", toc))
    present = {nb.stem for nb in NOTEBOOKS}
    assert present == listed, (
        f"chapters on disk but not in _toc.yml: {present - listed}; in _toc.yml but missing: {listed - present}"
    )


def test_readme_has_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make book" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
