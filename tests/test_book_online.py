"""The book online and in Jupyter: the Pages workflow, the repository and launch buttons, and
`make lab` with the project's kernel.

The workflow cannot run here, so its YAML is checked: it parses, builds with the README's book
command, uploads _build/html and deploys it. The kernel test starts a kernel from this environment
and runs a chapter's first cells, as `make lab` would.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


def readme_book_command() -> str:
    """The command the README gives for building the book (the line of its code block)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    line = next(ln for ln in block.splitlines() if "book" in ln.split("#")[0])
    return line.split("#")[0].strip()


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def test_workflow_builds_with_the_readme_command_and_deploys_the_html() -> None:
    wf = yaml.safe_load(WORKFLOW.read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "main" in triggers["push"]["branches"] and "workflow_dispatch" in triggers
    assert wf["permissions"]["pages"] == "write" and wf["permissions"]["id-token"] == "write"
    assert wf["concurrency"]["group"]

    command = readme_book_command()
    assert command == "make book"
    build = wf["jobs"]["build"]
    runs = [s["run"].strip() for s in steps(build) if "run" in s]
    assert command in runs, (
        f"the workflow must run the README's book command {command!r}, runs {runs}"
    )
    uploads = [
        s for s in steps(build) if s.get("uses", "").startswith("actions/upload-pages-artifact@")
    ]
    assert len(uploads) == 1 and uploads[0]["with"]["path"] == "_build/html"
    assert runs.index(command) < [i for i, s in enumerate(steps(build)) if "run" in s][-1] + 1

    deploy = wf["jobs"]["deploy"]
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in steps(deploy))


def test_config_has_repository_issue_download_and_launch_buttons() -> None:
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = cfg["repository"]
    assert (
        re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo["url"])
        and repo["branch"] == "main"
    )
    assert cfg["html"]["use_repository_button"] is True and cfg["html"]["use_issues_button"] is True
    assert cfg["sphinx"]["config"]["html_theme_options"]["use_download_button"] is True
    assert (
        cfg["sphinx"].get("recursive_update") is True
    )  # or html_theme_options would replace the buttons
    launch = cfg["launch_buttons"]
    assert launch["colab_url"].startswith("https://colab.research.google.com")
    assert launch["binderhub_url"].startswith("https://mybinder.org")


@pytest.mark.pages  # runs after the strict build (`make test`'s pages step)
def test_built_pages_carry_the_buttons() -> None:
    page = ROOT / "_build" / "html" / "chapters" / "01_the_inference_path.html"
    if not page.exists():
        pytest.skip("the book is not built (the strict build runs before the page checks)")
    html = page.read_text()
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    assert f"{url}/issues/new" in html and f'href="{url}"' in html
    assert "colab.research.google.com/github/" in html and "mybinder.org/v2/gh/" in html
    assert "_sources/chapters/01_the_inference_path.ipynb" in html  # the download button


def test_make_lab_opens_the_chapters_on_the_venv_kernel() -> None:
    make = (ROOT / "Makefile").read_text()
    target = re.search(r"^lab:(.*)\n((?:\t.*\n)+)", make, re.M)
    assert target, "the Makefile has no lab target"
    assert set(target.group(1).split()) >= {"venv", "fetch"}, "make lab must set up like make book"
    recipe = target.group(2)
    assert "$(BIN)/python -m ipykernel install --sys-prefix" in recipe
    assert "$(BIN)/jupyter lab" in recipe and "chapters/" in recipe
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["book"]
    assert any(d.startswith("jupyterlab") for d in extra)
    if shutil.which("make"):
        dry = subprocess.run(
            ["make", "-n", "-W", "pyproject.toml", "lab"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        assert ".venv/bin/jupyter lab" in dry


def test_a_kernel_from_this_environment_runs_a_chapter() -> None:
    """Start the environment's own kernel, as `make lab` does, and run chapter 1's first cells."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "chapters" / "01_the_inference_path.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    probe = nbformat.v4.new_code_cell(
        "import sys, llmlib\nprint(sys.executable)\nprint(llmlib.__file__)"
    )
    nb.cells = code[:3] + [probe]  # the install cell, the imports, the first figure
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "chapters")}},
    )
    client.execute()
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    executable, module = out.split()
    assert Path(executable).resolve() == Path(sys.executable).resolve(), (
        "the kernel is not this environment's"
    )
    assert Path(module).resolve().is_relative_to(ROOT), "the kernel imported another llmlib"
    assert any(o.get("output_type") == "display_data" for o in nb.cells[2].outputs), (
        "the figure was not drawn"
    )


@pytest.mark.slow
def test_jupyterlab_serves_the_chapters(tmp_path: Path) -> None:
    """What `make lab` starts: JupyterLab on 127.0.0.1 listing the chapters, a python3 kernel."""
    jupyter = Path(sys.executable).with_name("jupyter")
    if not jupyter.exists():
        pytest.skip("no jupyter next to this Python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            str(jupyter),
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--IdentityProvider.token=",
            f"--ServerApp.root_dir={ROOT}",
            "--ServerApp.open_browser=False",
            "--allow-root",
        ],  # CI containers run as root
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                listing = json.load(
                    urllib.request.urlopen(f"{base}/api/contents/chapters", timeout=2)
                )
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start")
        names = {item["name"] for item in listing["content"]}
        assert "01_the_inference_path.ipynb" in names
        assert urllib.request.urlopen(f"{base}/lab", timeout=10).status == 200
        specs = json.load(urllib.request.urlopen(f"{base}/api/kernelspecs", timeout=10))
        assert "python3" in specs["kernelspecs"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
