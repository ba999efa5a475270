"""A headless Chromium driven over the DevTools protocol (websocket-client),
for tests that load a page as a person would.

    with Browser() as b:
        b.open(url)
        b.evaluate("document.title")
        b.screenshot(path)

`find_chromium()` is None where no Chromium is installed; tests skip then.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps", "--disable-extensions", "--window-size=1200,900",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]
START_TIMEOUT = 60.0


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, executable: str | None = None) -> None:
        import websocket

        exe = executable or find_chromium()
        assert exe, "no Chromium"
        self.profile = tempfile.mkdtemp(prefix="radixlm-chromium-")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile}",
                                      "about:blank"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.ids = itertools.count(1)
        try:
            port = self._devtools_port()
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()
                     if t["type"] == "page"]
            self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"],
                                                  timeout=30, suppress_origin=True)
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        """Chromium writes the port it picked into the profile once it listens."""
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """The expression's value once truthy (or at the timeout); while the page
        is still loading it may throw, which counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
