"""The book's prose rules, on every notebook of both parts (tests/prose_rules.py measures them).

A learner reads one idea at a time: short sentences, what the chapter will teach up front, boxes
where an idea lands, a summary, and problems to do with pencil and paper, each with a worked
answer to open. Records from named machines live in results/, not in the prose.
"""

from __future__ import annotations

import re
from pathlib import Path

import prose_rules as P
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the core: chapters 1-11, one stage of inference each
CORE = sorted((ROOT / "chapters").glob("[01][0-9]_*.ipynb"))
#: "Going further": what the engine adds, each building on the core
FURTHER = sorted((ROOT / "chapters").glob("g[0-9]_*.ipynb"))
CHAPTERS = CORE + FURTHER
#: a core chapter's prose, in words (code spans count one)
CORE_WORDS = 2500


def test_two_parts_in_the_table_of_contents() -> None:
    """The core chapters under "The inference path", the rest under "Going further", in order."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    parts = {p["caption"]: [c["file"] for c in p["chapters"]] for p in toc["parts"]}
    assert parts["The inference path"] == [f"chapters/{p.stem}" for p in CORE]
    assert parts["Going further"] == [f"chapters/{p.stem}" for p in FURTHER]
    assert len(CORE) == 11 and len(FURTHER) >= 4


@pytest.mark.parametrize("nb", CORE, ids=lambda p: p.stem)
def test_a_core_chapter_is_within_its_word_budget(nb: Path) -> None:
    n = sum(P.words(s) for s in P.sentences(P.markdown(nb)))
    assert n <= CORE_WORDS, n


@pytest.mark.parametrize("nb", CORE, ids=lambda p: p.stem)
def test_the_running_question_goes_through_every_core_chapter(nb: Path) -> None:
    """Each core chapter follows the same question (llmlib.show.QUESTION) a step further."""
    import json

    code = "\n".join(
        "".join(c["source"])
        for c in json.loads(nb.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    assert "QUESTION" in code, nb.name


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_records_from_other_machines_are_shown_collapsed(nb: Path) -> None:
    """A notebook that reads a record in results/ shows it through llmlib.show.recorded, which
    folds the table under a line naming the record's machine and date."""
    import json

    code = "\n".join(
        "".join(c["source"])
        for c in json.loads(nb.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    if "results/" in code:
        assert "recorded(" in code, nb.name


def test_recorded_names_the_record_and_folds_its_table(tmp_path: Path) -> None:
    from llmlib.show import recorded

    rec = tmp_path / "r.json"
    rec.write_text('{"machine": {"cpu": "Some CPU", "date": "2026-01-02T03:04:05"}, "x": 1}')
    md = getattr(recorded(rec, [{"a": 1.23456, "b": "z"}], {"a": "A", "b": "B"}), "data", "")
    assert md.startswith("<details><summary>Recorded on other machines")
    assert "Some CPU, 2026-01-02" in md and "| A | B |" in md and "| 1.23 | z |" in md


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_sentences_are_short(nb: Path) -> None:
    """At most 2% of a chapter's sentences over 40 words, none over 60."""
    n = [P.words(s) for s in P.sentences(P.markdown(nb))]
    long = [s for s in P.sentences(P.markdown(nb)) if P.words(s) > 40]
    assert sum(k > 60 for k in n) == 0, [s for s in long if P.words(s) > 60]
    assert len(long) <= 0.02 * len(n), long


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_no_dates_or_machine_names_in_the_prose(nb: Path) -> None:
    assert P.DATED.findall(P.markdown(nb)) == []


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_the_chapter_is_scaffolded(nb: Path) -> None:
    """What the reader will be able to do (in the first markdown cell), at least two takeaway
    boxes, a summary, and at least two problems with their answers in dropdowns."""
    import json

    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown"]
    first = "".join(cells[0]["source"])
    md = P.markdown(nb)
    assert "{admonition} What you will be able to do" in first
    assert len(re.findall(r"\{admonition\} Takeaway\s*\n:class: important", md)) >= 2
    assert re.search(r"^## Summary\s*$", md, re.M)
    assert re.search(r"^## Problems\s*$", md, re.M)
    answers = re.findall(r"\{admonition\} Answer\s*\n:class: dropdown", md)
    problems = re.findall(r"\*\*Problem \d+\.\*\*", md)
    assert len(problems) >= 2 and len(answers) >= len(problems), (len(problems), len(answers))


def test_listings_show_forty_lines_and_fold_the_rest() -> None:
    """show_source shows the first 40 lines of each object and folds the rest under a line to
    open; a short object is shown whole."""
    from llmlib.engine.scheduler import Scheduler
    from llmlib.show import show_source, source_of

    def text(x) -> str:
        return getattr(x, "data", x)

    long = text(show_source(Scheduler.schedule))
    n = len(source_of(Scheduler.schedule).rstrip().splitlines())
    assert n > 40
    shown, folded = long.split("<details>")
    assert shown.count("\n") <= 40 + 4  # the fence, the header line, the 40 lines
    assert f"the other {n - 40} lines" in folded
    short = text(show_source(P.words))
    assert "<details>" not in short and "def words" in short


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_figures_have_alt_text_and_a_concept_diagram_is_referenced(nb: Path) -> None:
    """Every figure has alt text (a drawn one in its directive, a plotted one in its cell's
    metadata); the chapter has a concept diagram of its own (chapters/figures/NN-*.svg) that
    exists, and the prose refers to every drawn figure by name."""
    import json

    md = P.markdown(nb)
    drawn = re.findall(r"```\{figure\} (\S+)\n((?::[a-z]+:.*\n)*)", md)
    if nb in CORE:
        assert any(src.startswith(f"figures/{nb.name[:2]}-") for src, _ in drawn), nb.name
    for src, opts in drawn:
        assert (nb.parent / src).is_file(), src
        assert re.search(r":alt: \S", opts), src
        name = re.search(r":name: (\S+)", opts)
        assert name and f"{{numref}}`{name.group(1)}`" in md, src
    for c in json.loads(nb.read_text())["cells"]:
        meta = c.get("metadata", {}).get("mystnb", {})
        if "figure" in meta:
            assert meta.get("image", {}).get("alt"), meta["figure"].get("name")


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_every_listing_names_code_that_exists(nb: Path) -> None:
    """Each ``show_source(...)`` argument built from the notebook's llmlib imports resolves, so a
    renamed function fails here in seconds rather than in the strict book build."""
    import ast
    import json

    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    trees = [ast.parse("".join(c["source"])) for c in cells]
    imports = [
        n
        for t in trees
        for n in ast.walk(t)
        if (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("llmlib"))
        or (isinstance(n, ast.Import) and all(a.name.startswith("llmlib") for a in n.names))
    ]
    ns: dict = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), nb.name, "exec"), ns)
    for t in trees:
        for call in ast.walk(t):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "show_source":
                for arg in call.args:
                    root = arg
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in ns:
                        eval(compile(ast.Expression(arg), nb.name, "eval"), ns)


# ---- the core is a path: no engine internals, no forward jumps ----------------------------------

#: a box of its own in a core chapter: a Going-further notebook named for the curious
CURIOUS = re.compile(
    r"^(```|:::)\{admonition\} Going further\n:class: seealso\n.*?^\1\s*$", re.S | re.M
)


def _going_further_labels() -> set[str]:
    return {lab for nb in FURTHER for lab in re.findall(r"^\(([\w-]+)\)=", P.markdown(nb), re.M)}


@pytest.mark.parametrize("nb", CORE[:-1], ids=lambda p: p.stem)
def test_a_core_chapter_runs_without_the_engines_internals(nb: Path) -> None:
    """Chapters 1-10 build and measure the stages with the book's own modules; the kernels and
    the runtime (compiled steps, CUDA graphs) are the Going-further notebooks'. Chapter 11 may use
    the runtime: its generator runs on it."""
    import json

    code = "\n".join(
        "".join(c["source"])
        for c in json.loads(nb.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    found = re.findall(
        r"llmlib\.(?:kernels|runtime)\b|from llmlib import[^\n]*\b(?:kernels|runtime)\b", code
    )
    assert not found, f"{nb.name} imports the engine's internals: {found}"


@pytest.mark.parametrize("nb", CORE, ids=lambda p: p.stem)
def test_a_core_chapter_points_to_going_further_only_for_the_curious(nb: Path) -> None:
    """A core chapter may name a Going-further notebook in a "Going further" box, never in its
    own text, so a reader who skips every box loses nothing the core needs."""
    prose = CURIOUS.sub("", P.markdown(nb))
    links = re.findall(r"\]\((?:\.\./chapters/|\./)?g\d_[^)]*\)", prose)
    refs = [
        r
        for r in re.findall(r"\{ref\}`(?:[^`<]*<)?([\w-]+)>?`", prose)
        if r in _going_further_labels()
    ]
    assert not links and not refs, f"{nb.name}: outside a Going further box: {links + refs}"
