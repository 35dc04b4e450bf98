"""A small client of the Chrome DevTools Protocol: headless Chromium driven from a test.

``--dump-dom`` reads a static page; JupyterLab renders its notebooks with scripts, over a
websocket to its server, so a test has to wait for the cells and then read the DOM. This starts
Chromium with a fresh profile and a debugging port, and speaks to its one page over
``websocket-client`` (a dependency of jupyter_server).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium page: ``goto``, ``eval`` (JavaScript), ``wait_for``, ``screenshot``."""

    def __init__(self, width: int = 1280, height: int = 1600, timeout: float = 60) -> None:
        import websocket

        exe = chromium()
        assert exe, "headless Chromium is needed: `apt-get install chromium` (make test does this)"
        self.profile = Path(tempfile.mkdtemp(prefix="llmlib-chromium-"))
        self.proc = subprocess.Popen(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--no-first-run",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={self.profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = self.profile / "DevToolsActivePort"
        end = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < end and self.proc.poll() is None, "Chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in pages if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout)
        self.n = 0
        self.call("Page.enable")

    def call(self, method: str, **params: Any) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:  # events arrive in between; the reply carries our id
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str) -> Any:
        r = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"].get("text", "script error"))
        return r["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 60) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.eval(expression):
                    return True
            except RuntimeError:  # the page is between documents
                pass
            time.sleep(0.25)
        return False

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)
