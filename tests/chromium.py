"""Debian's chromium, headless, driven over the DevTools protocol (websockets), for tests that
look at a page as a person would: open it, wait until something shows, read the DOM, take a
screenshot. No browser download: dev.sh installs the chromium package."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

REPO = Path(__file__).resolve().parents[1]
# Screenshots the tests save for people to look at (git-ignored).
ARTIFACTS = REPO / "test-artifacts"


class Chromium:
    """One headless browser with one page."""

    def __init__(self, width: int = 1400, height: int = 1000):
        self.width, self.height = width, height
        self._ids = itertools.count(1)
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        self._process: subprocess.Popen | None = None
        self._socket: ClientConnection | None = None
        self._session = ""

    async def __aenter__(self) -> Chromium:
        binary = shutil.which("chromium")
        if binary is None:
            raise RuntimeError("chromium is missing: ./dev.sh setup installs Debian's chromium package")
        self._process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        browser_url = await self._devtools_url()
        self._socket = await connect(browser_url, max_size=None)
        target = await self._call("Target.createTarget", url="about:blank")
        attached = await self._call("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        self._session = attached["sessionId"]
        await self._call("Page.enable")
        await self._call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    async def __aexit__(self, *_) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._process is not None:
            # The whole process group: chromium's helpers (renderer, crashpad) still write to the
            # profile for a moment after the browser process ends.
            os.killpg(self._process.pid, signal.SIGTERM)
            self._process.wait(timeout=10)
            deadline = time.monotonic() + 10
            while _group_alive(self._process.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if _group_alive(self._process.pid):
                os.killpg(self._process.pid, signal.SIGKILL)
        self._profile.cleanup()

    async def _devtools_url(self) -> str:
        # chromium writes its port and the browser's websocket path here once it listens
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or len(port_file.read_text().split()) < 2:
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            await asyncio.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        return f"ws://127.0.0.1:{port}{path}"

    async def _call(self, method: str, **params: Any) -> dict:
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params}
        if self._session:
            message["sessionId"] = self._session
        await self._socket.send(json.dumps(message))
        while True:  # events arrive in between; the answer carries our id
            answer = json.loads(await self._socket.recv())
            if answer.get("id") == message_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    async def open(self, url: str) -> None:
        """Navigate, and wait until the page has loaded (a single-page app renders after that)."""
        await self._call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && document.body !== null", 30, f"{url} to load")

    async def evaluate(self, expression: str) -> Any:
        result = await self._call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll a JavaScript expression until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            await asyncio.sleep(0.25)

    async def screenshot(self, name: str) -> Path:
        """A PNG of the whole page under test-artifacts/."""
        ARTIFACTS.mkdir(exist_ok=True)
        shot = await self._call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path = ARTIFACTS / name
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
