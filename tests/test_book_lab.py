"""Look at the chapters where readers run them: each executed notebook opened in JupyterLab.

`make lab` opens the chapters in JupyterLab, where jupyterlab-myst (in the book's extras) renders
their MyST markdown; Binder opens them there too. After the book's build, this test opens every
executed notebook the build left in ``_build/jupyter_execute`` in JupyterLab, in headless Chromium,
and reads the page as a learner sees it. A chapter fails when its rendered text shows raw role or
directive syntax, uses a role JupyterLab does not render (``{glue}``: it would show as a bare
name), misses a number its prose quotes, shows a concept figure as anything but a loaded picture,
or shows an answer or a solution unfolded. Each chapter's screenshot is kept under
``_build/screenshots/lab/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cdp import Browser, chromium

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = ROOT / "_build" / "jupyter_execute" / "chapters"
SHOTS = ROOT / "_build" / "screenshots" / "lab"
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

pytestmark = pytest.mark.pages

#: what a reader must never see: MyST written out instead of rendered
RAW = ("{glue", "{eval}", "{term}", "{cite", "{numref}", "{ref}", ":class:", ":name:", ":alt:",
       ":::{", "```{")  # fmt: skip
#: the roles jupyterlab-myst renders; another role shows as its bare text (``{glue:text}`x:.1f```
#: as "x:.1f"), so using one fails here before a reader sees it
RENDERED_ROLES = {"eval", "term", "cite", "cite:p", "cite:t", "numref", "ref", "doc", "math"}
ROLE = re.compile(r"\{([a-z][a-z:-]*)\}`")

READ_PAGE = """(() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  if (!nb) return null;
  const md = Array.from(nb.querySelectorAll('.jp-MarkdownCell'));
  return {
    markdown: md.map(c => c.innerText),
    rendered: md.filter(c => c.querySelector('.myst, .jp-RenderedMarkdown')).length,
    // an output's prose, without its code listings (a docstring may say :class:`X`)
    outputs: Array.from(nb.querySelectorAll('.jp-OutputArea-output')).map(o => {
      const c = o.cloneNode(true);
      c.querySelectorAll('pre').forEach(p => p.remove());
      return c.textContent;
    }),
    images: Array.from(nb.querySelectorAll('.jp-MarkdownCell img')).map(
      i => [i.getAttribute('src') || '', i.complete ? i.naturalWidth : -1]),
    closed: md.reduce((n, c) => n + c.querySelectorAll('details:not([open])').length, 0),
    open: md.reduce((n, c) => n + c.querySelectorAll('details[open]').length, 0),
    folded_inputs: nb.querySelectorAll('.jp-InputPlaceholder').length,
    folded_outputs: nb.querySelectorAll('.jp-OutputPlaceholder').length,
  };
})()"""


def _markdown(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def problems(nb: dict, page: dict) -> list[str]:
    """What a reader of ``nb`` would see wrong on the JupyterLab ``page`` read by READ_PAGE."""
    found = []
    md = _markdown(nb)
    for role in sorted({r for s in md for r in ROLE.findall(s)} - RENDERED_ROLES):
        found.append(f"uses {{{role}}}, which JupyterLab shows as bare text")
    for i, text in enumerate(page["markdown"] + page["outputs"]):
        for raw in RAW:
            if raw in text:
                where = text[max(0, text.index(raw) - 60) : text.index(raw) + 60]
                found.append(f"shows raw {raw!r}: ...{where}...")
    for text in page["markdown"]:
        for error in re.findall(r"\S+ - Unknown (?:Directive|Role)", text):
            found.append(f"shows {error!r}")
    if page["rendered"] < len(md):
        found.append(f"{len(md) - page['rendered']} of {len(md)} markdown cells not rendered")
    # every number the prose quotes is on the page, where the prose quotes it
    md_cells = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    for cell, text in zip(md_cells, page["markdown"]):
        for expr in cell["metadata"].get("user_expressions", []):
            value = expr["result"].get("data", {}).get("text/plain", "").strip("'\"")
            if value not in text:
                found.append(f"the value of {expr['expression']} ({value}) is not shown")
    for s in md:
        for src in re.findall(r"```\{figure\} (\S+)", s):
            name = Path(src).name
            loaded = [w for u, w in page["images"] if name in u]
            if not loaded or max(loaded) <= 0:
                found.append(f"figure {src} is not drawn as a picture")
    answers = sum(len(re.findall(r"\{admonition\} Answer\s*\n:class: dropdown", s)) for s in md)
    if page["closed"] < answers or page["open"]:
        found.append(f"{answers} answers, {page['closed']} folded, {page['open']} open")
    folded = [
        c for c in nb["cells"] if c["metadata"].get("jupyter", {}).get("source_hidden")
    ]  # fmt: skip
    if page["folded_inputs"] < len(folded):
        found.append(f"{len(folded)} cells to fold, {page['folded_inputs']} folded")
    return found


class Lab:
    """JupyterLab on a folder of notebooks, and one Chromium page that opens them."""

    def __init__(self, root: Path, state: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.token = "inference-path-test"
        for key, value in {  # the notebook list scrolls no cell out of the DOM; no news pop-up
            "notebook-extension/tracker": {"windowingMode": "none"},
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        }.items():
            path = state / "settings" / "@jupyterlab" / f"{key}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = {**os.environ, "JUPYTER_DATA_DIR": str(state / "data")}
        jupyter = Path(sys.executable).with_name("jupyter")
        self.proc = subprocess.Popen(
            [
                str(jupyter),
                "lab",
                "--no-browser",
                "--allow-root",  # CI containers run as root
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}",
                f"--LabApp.user_settings_dir={state / 'settings'}",
                f"--LabApp.workspaces_dir={state / 'workspaces'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=state,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 60
        while True:
            try:
                self.api("status")
                break
            except OSError:
                assert time.monotonic() < end and self.proc.poll() is None, "no JupyterLab"
                time.sleep(0.3)
        self.browser = Browser()

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(
            f"{self.base}/api/{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def read(self, rel: str, nb: dict, shot: Path, timeout: float = 90) -> dict:
        """Open ``rel`` (a path under the root), wait until every markdown cell is rendered and
        every picture has loaded, screenshot it, and read it."""
        n_md = len(_markdown(nb))
        self.browser.goto(f"{self.base}/lab/tree/{rel}?token={self.token}&reset")
        ready = f"""(() => {{ const p = {READ_PAGE};
            return p && p.rendered >= {n_md} && p.images.every(i => i[1] >= 0); }})()"""
        self.browser.wait_for(ready, timeout)
        time.sleep(1.0)  # math and the last layout pass
        page = self.browser.eval(READ_PAGE) or {}
        self.browser.screenshot(shot)
        for kernel in self.api("kernels"):  # opening a notebook starts its kernel; stop it
            self.api(f"kernels/{kernel['id']}", method="DELETE")
        return page

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    if not chromium():
        pytest.fail("headless Chromium is needed: `apt-get install chromium` (make test does this)")
    assert EXECUTED.is_dir(), f"{EXECUTED} is missing: build the book first (make test does)"
    from nbformat import reads
    from nbformat.sign import NotebookNotary

    tmp = tmp_path_factory.mktemp("lab")
    root, state = tmp / "book", tmp / "state"
    (root / "chapters").mkdir(parents=True)
    shutil.copytree(ROOT / "chapters" / "figures", root / "chapters" / "figures")
    # the build's own executed notebooks, trusted as a reader's own run is: JupyterLab shows the
    # numbers an untrusted notebook's markdown quotes only after its cells run again
    (state / "data").mkdir(parents=True)
    notary = NotebookNotary(data_dir=str(state / "data"))
    for nb in EXECUTED.glob("*.ipynb"):
        text = nb.read_text()
        (root / "chapters" / nb.name).write_text(text)
        notary.sign(reads(text, as_version=4))
    started = Lab(root, state)
    started.root = root
    yield started
    started.close()


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_reads_right_in_jupyterlab(lab: Lab, nb: Path) -> None:
    executed = EXECUTED / nb.name
    assert executed.exists(), f"{executed} was not built"
    book = json.loads(executed.read_text())
    page = lab.read(f"chapters/{nb.name}", book, SHOTS / f"{nb.stem}.png")
    assert page, f"{nb.name} did not open in JupyterLab"
    found = problems(book, page)
    assert not found, f"{nb.name} in JupyterLab (screenshot {SHOTS / nb.stem}.png):\n" + "\n".join(
        found
    )


def test_the_check_sees_raw_markup(lab: Lab) -> None:
    """The same check on a notebook written the way JupyterLab cannot show: it must complain."""
    import nbformat

    bad = nbformat.v4.new_notebook()
    bad.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    bad.cells = [
        nbformat.v4.new_markdown_cell(
            "# Raw\n\nA number the build glued: {glue:text}`x:.1f` GB.\n\n"
            "```{figure} figures/no-such-figure.svg\n:name: fig-raw\n:alt: a picture\n```\n\n"
            "```{admonitio} Answer\n:class: dropdown\n42\n```\n\n"
            "    ```{admonition} Takeaway\n    :class: important\n    Indented, so code.\n    ```\n"
        ),
    ]
    text = nbformat.writes(bad)
    (lab.root / "chapters" / "raw.ipynb").write_text(text)
    found = problems(
        json.loads(text), lab.read("chapters/raw.ipynb", json.loads(text), SHOTS / "raw.png")
    )
    for what in ("{glue:text}", "raw ':class:'", "Unknown Directive", "no-such-figure.svg"):
        assert any(what in f for f in found), (what, found)
