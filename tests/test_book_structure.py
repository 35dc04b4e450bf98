"""What every chapter of the book must have: the install cell, captioned figures, exercises with
checked solutions, glossary links, code that fits the page, and cited sources.

These read the committed notebooks (no execution); the strict build executes them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))


def cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def code_cells(nb: Path) -> list[dict]:
    return [c for c in cells(nb) if c["cell_type"] == "code"]


def tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def repository_url() -> str:
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


# ---- the first code cell: install llmlib where it is missing (Colab, Binder) -------------------

INSTALL = source(code_cells(NOTEBOOKS[0])[0]) if NOTEBOOKS else ""


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_is_the_install_cell(nb: Path) -> None:
    first = code_cells(nb)[0]
    assert source(first) == INSTALL, (
        f"{nb.name}: the first code cell must be the same install cell as chapter 1's"
    )
    assert "hide-cell" in tags(first), f"{nb.name}: fold the install cell (tag hide-cell)"
    assert 'find_spec("llmlib")' in INSTALL and repository_url() in INSTALL


def _run_install_cell(
    monkeypatch: pytest.MonkeyPatch, cwd: Path, installed: bool
) -> tuple[list, list]:
    """Execute the install cell with pip, git and chdir recorded instead of run."""
    import importlib.util

    calls: list[list[str]] = []
    moved: list[str] = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: real_find_spec(name, *a) if installed or name != "llmlib" else None,
    )
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(list(cmd)))
    monkeypatch.setattr(os, "chdir", lambda path: moved.append(str(path)))
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(INSTALL, "install-cell", "exec"), {})
    return calls, moved


def test_install_cell_does_nothing_where_llmlib_is_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls, moved = _run_install_cell(monkeypatch, tmp_path, installed=True)
    assert calls == [] and moved == []


def test_install_cell_on_colab_clones_and_installs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Colab: the notebook alone, in /content; nothing of the repository around it
    calls, moved = _run_install_cell(monkeypatch, tmp_path, installed=False)
    root = tmp_path / "the-inference-path"
    assert calls[0] == ["git", "clone", "--depth=1", repository_url(), str(root)]
    pip = calls[1]
    assert pip[:4] == [sys.executable, "-m", "pip", "install"] and f"{root}[book]" in pip
    assert moved == [str(root / "chapters")]


def test_install_cell_on_binder_installs_the_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Binder: the repository is the working tree and the notebook runs in its chapters/
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'llmlib'\n")
    (tmp_path / "chapters").mkdir()
    calls, moved = _run_install_cell(monkeypatch, tmp_path / "chapters", installed=False)
    assert len(calls) == 1 and calls[0][:4] == [sys.executable, "-m", "pip", "install"]
    assert f"{tmp_path}[book]" in calls[0]  # the one call is pip's: nothing was cloned
    assert moved == [str(tmp_path / "chapters")]


# ---- figures, listings, exercises ----------------------------------------------------------------

DRAWS = re.compile(r"plt\.show\(\)|\bbench\.plot\(")


def test_every_figure_has_a_caption_a_name_and_alt_text() -> None:
    names: list[str] = []
    for nb in NOTEBOOKS:
        for i, c in enumerate(code_cells(nb)):
            if not DRAWS.search(source(c)):
                continue
            meta = c.get("metadata", {}).get("mystnb", {})
            fig, img = meta.get("figure", {}), meta.get("image", {})
            where = f"{nb.name}, code cell {i}"
            assert len(fig.get("caption", "").split()) >= 8, f"{where}: a figure needs a caption"
            assert fig.get("name", "").startswith("fig-"), (
                f"{where}: name the figure (fig-...) to refer to it"
            )
            assert len(img.get("alt", "").split()) >= 8, f"{where}: a figure needs alt text"
            assert "hide-input" in tags(c), f"{where}: fold the plotting code (tag hide-input)"
            names.append(fig["name"])
    assert len(names) >= 40
    assert len(names) == len(set(names)), "figure names must be unique across the book"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_ends_with_exercises_and_checked_folded_solutions(nb: Path) -> None:
    cs = cells(nb)
    start = next(
        (
            i
            for i, c in enumerate(cs)
            if c["cell_type"] == "markdown" and re.search(r"^## Exercises\s*$", source(c), re.M)
        ),
        None,
    )
    assert start is not None, f"{nb.name}: no '## Exercises' section"
    # "Exercise 9.2" in chapter 9, "Exercise G1.2" in Going further 1
    number = f"G{nb.name[1]}" if nb.name.startswith("g") else str(int(nb.name[:2]))
    tasks = [
        i
        for i, c in enumerate(cs)
        if i >= start
        and c["cell_type"] == "markdown"
        and re.search(rf"^\*\*Exercise {number}\.\d+", source(c), re.MULTILINE)
    ]
    assert 2 <= len(tasks) <= 4, f"{nb.name}: {len(tasks)} exercises (2 to 4 wanted)"
    for i in tasks:
        solution = cs[i + 1]
        assert solution["cell_type"] == "code", (
            f"{nb.name}: exercise at cell {i} has no solution cell under it"
        )
        assert {"hide-cell", "hide-input"} & set(tags(solution)), (
            f"{nb.name}: fold the solution at cell {i + 1}"
        )
        assert "assert" in source(solution), (
            f"{nb.name}: the solution at cell {i + 1} must check its result"
        )
        prompt = solution["metadata"].get("mystnb", {}).get("code_prompt_show", "")
        assert "solution" in prompt, f"{nb.name}: label the fold at cell {i + 1} a solution"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_its_own_id(nb: Path) -> None:
    """nbformat 4.5 gives each cell an id (the build warns where one is missing, and nbformat
    means to refuse such notebooks): a cell added by hand must get one too."""
    ids = [c.get("id") for c in cells(nb)]
    missing = [i for i, c in enumerate(ids) if not c]
    assert not missing, f"{nb.name}: cells without an id: {missing}"
    assert len(set(ids)) == len(ids), f"{nb.name}: cell ids repeat"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_fits_the_page(nb: Path) -> None:
    wide = [
        (i, line)
        for i, c in enumerate(code_cells(nb))
        for line in source(c).splitlines()
        if len(line) > 88
    ]
    assert not wide, (
        f"{nb.name}: code lines longer than 88 characters are clipped on the page: {wide[:3]}"
    )


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_no_progress_bars_or_bare_reprs(nb: Path) -> None:
    for i, c in enumerate(code_cells(nb)):
        last = source(c).rstrip().splitlines()[-1] if source(c).strip() else ""
        # a cell ending in torch.manual_seed(...) would print "<torch._C.Generator ...>"
        assert not re.match(r"\s*torch\.manual_seed\([^)]*\)\s*(#.*)?$", last), (
            f"{nb.name} cell {i}: end it with ';'"
        )
        assert "train_bpe(" not in source(c) or "progress=False" in source(c), (
            f"{nb.name} cell {i}: no progress bar"
        )


# ---- the glossary and its links ----------------------------------------------------------------


def glossary_terms() -> set[str]:
    text = (ROOT / "glossary.md").read_text()
    block = text.split("```{glossary}", 1)[1].split("```", 1)[0]
    return {
        line.strip().lower()
        for line in block.splitlines()
        if line.strip() and not line.startswith((" ", ":"))
    }


def test_glossary_has_at_least_45_terms() -> None:
    terms = glossary_terms()
    assert len(terms) >= 45, len(terms)
    for t in (
        "softmax",
        "rmsnorm",
        "lm head",
        "bf16",
        "quantization",
        "temperature",
        "top-k",
        "top-p",
        "min-p",
        "flashattention",
        "mfu",
        "mbu",
        "preemption",
        "prefix caching",
        "ttft",
        "tpot",
        "itl",
        "cuda graphs",
        "tensor parallelism",
        "speculative decoding",
        "hbm",
        "eager",
        "perplexity",
    ):
        assert t in terms, f"the glossary lacks {t!r}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_links_the_glossary(nb: Path) -> None:
    prose = "\n".join(source(c) for c in cells(nb) if c["cell_type"] == "markdown")
    refs = re.findall(r"\{term\}`([^`]+)`", prose)
    assert len(refs) >= 3, f"{nb.name}: link the terms it introduces to the glossary with {{term}}"
    terms = glossary_terms()
    for ref in refs:
        target = re.search(r"<([^>]+)>\s*$", ref)
        name = " ".join((target.group(1) if target else ref).split()).lower()
        assert name in terms, f"{nb.name}: {{term}}`{ref}` has no glossary entry"


# ---- sources -----------------------------------------------------------------------------------


def test_source_articles_are_in_the_bibliography_and_cited_from_chapter_1() -> None:
    bib = (ROOT / "references.bib").read_text()
    for key, title in (
        ("inference_path_article", "How an {LLM} Answers a Question"),
        ("pathak2026inside", "What Happens Inside an {LLM}"),
    ):
        assert f"{{{key}," in bib and title in bib, key
        assert key in "".join(source(c) for c in cells(NOTEBOOKS[0])), (
            f"chapter 1 does not cite {key}"
        )


def test_intro_states_the_size_of_the_model_file() -> None:
    cache = Path(os.environ.get("LLMLIB_CACHE") or Path.home() / ".cache" / "llmlib").expanduser()
    found = sorted(cache.glob("SmolLM2-135M-Instruct*.gguf"))
    if not found:
        pytest.skip("the model file is not fetched here")
    path = found[0]
    stated = re.search(r"a (\d+) MB file", (ROOT / "intro.md").read_text())
    assert stated and int(stated.group(1)) == round(path.stat().st_size / 1e6)


# ---- one source for the book, JupyterLab and plain Markdown -------------------------------------

#: the roles the book uses that jupyterlab-myst renders too (tests/test_book_lab.py looks)
ROLES_SHOWN_EVERYWHERE = {
    "eval",
    "term",
    "cite",
    "cite:p",
    "cite:t",
    "numref",
    "ref",
    "doc",
    "math",
}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_prose_uses_only_roles_jupyterlab_renders(nb: Path) -> None:
    """``{glue}`` is myst-nb's alone: JupyterLab would show its bare name where the number goes."""
    prose = "\n".join(source(c) for c in cells(nb) if c["cell_type"] == "markdown")
    used = set(re.findall(r"\{([a-z][a-z:-]*)\}`", prose))
    assert used <= ROLES_SHOWN_EVERYWHERE, f"{nb.name}: {used - ROLES_SHOWN_EVERYWHERE}"
    code = "\n".join(source(c) for c in code_cells(nb))
    assert "myst_nb" not in code, f"{nb.name}: the notebooks run without the book's build"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_quoted_value_is_computed_and_printed_above_its_text(nb: Path) -> None:
    """Each ``{eval}`name``` names a ``shown(...)`` value of a code cell above it, printed there too
    (``print(f"{name=}")``) for viewers that show the markdown raw."""
    defined: set[str] = set()
    printed: set[str] = set()
    for i, c in enumerate(cells(nb)):
        s = source(c)
        if c["cell_type"] == "code":
            for lhs in re.findall(r"^\s*([\w, ]+?)\s*=\s*\(?\s*\n?\s*shown\(", s, re.M):
                defined |= {n.strip() for n in lhs.split(",")}
            printed |= set(re.findall(r"\{(\w+)=\}", s))
        else:
            for name in re.findall(r"\{eval\}`([^`]+)`", s):
                assert name in defined, f"{nb.name}, cell {i}: {name} is not a shown() value above"
    quoted = {n for c in cells(nb) for n in re.findall(r"\{eval\}`([^`]+)`", source(c))}
    assert quoted <= printed, f"{nb.name}: quoted but not printed: {quoted - printed}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_the_book_folds_are_folded_in_jupyterlab(nb: Path) -> None:
    """The book folds by tags; JupyterLab by the cell's ``jupyter`` metadata. A solution or the
    setup cell folds whole, a figure's plotting code folds its input."""
    for i, c in enumerate(code_cells(nb)):
        fold = c.get("metadata", {}).get("jupyter", {})
        t = set(tags(c))
        if "hide-cell" in t:
            assert fold.get("source_hidden") and fold.get("outputs_hidden"), (nb.name, i)
        elif t & {"hide-input", "remove-input", "remove-cell"}:
            assert fold.get("source_hidden"), (nb.name, i)
