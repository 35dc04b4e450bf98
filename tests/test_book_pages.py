"""Look at the built book as a reader would: a headless Chromium screenshot of every chapter page.

Run after `jupyter-book build` (``make test`` does). A page fails when its screenshot is blank, when
its text shows a Python traceback or an error box, or when an image it references did not load
(a missing file, or one that does not decode).
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

pytestmark = pytest.mark.pages


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "headless Chromium is needed for the page checks: `apt-get install chromium` (make test does this)"
    )


def _screenshot(page: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--hide-scrollbars",
        "--virtual-time-budget=4000",
        f"--screenshot={out}",
        "--window-size=1280,1800",
        page.as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def _dom_after_scripts(page: Path) -> str:
    """The page's DOM once its scripts (MathJax among them) have run."""
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--virtual-time-budget=8000",
        "--dump-dom",
        page.as_uri(),
    ]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout


def _visible_text(markup: str) -> str:
    markup = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", markup)
    return html.unescape(re.sub(r"(?s)<[^>]+>", " ", markup))


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_page_renders(nb: Path) -> None:
    page = HTML / "chapters" / f"{nb.stem}.html"
    assert page.exists(), f"{page} was not built; run `make book` (or the strict build) first"
    markup = page.read_text(errors="replace")

    # No traceback or error output from an executed cell.
    text = _visible_text(markup)
    assert "Traceback (most recent call last)" not in text, f"{page.name} shows a Python traceback"
    for cls in ("output_error", "output traceback", "nb-output-error", "system-message"):
        assert f'class="{cls}' not in markup and f' {cls}"' not in markup, (
            f"{page.name} shows an error box ({cls})"
        )

    # Nothing is fetched from the network: the book must read the same offline.
    remote = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', markup)
    assert not [u for u in remote if re.search(r"\.(js|css|png|jpe?g|svg|woff2?)(\?|$)", u)], (
        f"{page.name} loads assets from the network: {remote}"
    )

    # Math is typeset (MathJax is served locally), not left as raw TeX.
    if "\\(" in markup or "\\[" in markup or 'class="math' in markup:
        dom = _dom_after_scripts(page)
        assert "mjx-container" in dom, (
            f"{page.name}: its math was not typeset (is MathJax loading?)"
        )

    # Every image it references exists and decodes to a non-empty picture.
    import matplotlib.image as mpimg

    srcs = re.findall(r'<img[^>]+src="([^"]+)"', markup)
    for src in srcs:
        if src.startswith("data:"):
            continue
        url = urlparse(src)
        assert not url.scheme or url.scheme == "file", (
            f"{page.name} loads an image from the network: {src}"
        )
        img = (page.parent / unquote(url.path)).resolve()
        assert img.exists(), f"{page.name}: image {src} did not load (no file {img})"
        if img.suffix.lower() in (".png", ".jpg", ".jpeg"):
            arr = mpimg.imread(img)
            assert arr.size > 0 and float(np.asarray(arr, dtype=float).std()) > 0, (
                f"{page.name}: image {src} is empty"
            )

    # The screenshot is not blank: a page with content has many distinct pixel values.
    shot = SHOTS / f"{nb.stem}.png"
    _screenshot(page, shot)
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.std() > 0.02, f"{page.name}: the screenshot {shot} is blank"
    dark = (pixels.mean(axis=-1) < 0.5).mean()
    assert dark > 0.002, f"{page.name}: the screenshot {shot} shows almost no text"


def test_intro_page_renders() -> None:
    page = HTML / "intro.html"
    assert page.exists(), "the landing page was not built"
    shot = SHOTS / "intro.png"
    _screenshot(page, shot)
    import matplotlib.image as mpimg

    assert mpimg.imread(shot)[..., :3].std() > 0.02
