"""A real headless Chromium for the dashboard tests, driven over the DevTools protocol.

Chromium runs with `--remote-debugging-pipe`: it reads protocol commands on its fd 3 and writes
answers and events on its fd 4, each a JSON message ended by a NUL byte. No port is opened, so
nothing but this test can drive it. The few commands the tests need: open a page, evaluate a
script in it, read its cookies, record the URLs it requested, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Browser", "BrowserError", "find_chromium"]

# Debian's package installs /usr/bin/chromium (.ci/run installs it when missing)
_NAMES = ("chromium", "chromium-browser", "google-chrome")
_TRAMPOLINE = """
import os, sys
os.dup2(int(sys.argv[1]), 3)
os.dup2(int(sys.argv[2]), 4)
os.close(int(sys.argv[1]))
os.close(int(sys.argv[2]))
os.execv(sys.argv[3], sys.argv[3:])
"""


def find_chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


# how long the browser may take to answer its first command (it is starting)
_START_TIMEOUT_S = 60.0


class BrowserError(Exception):
    """The browser answered a command with an error, or did not answer in time."""


class Browser:
    """One headless Chromium with one page (an async context manager)."""

    def __init__(self, binary: str, profile: Path, window: tuple[int, int] = (1280, 900)) -> None:
        self._binary = binary
        self._profile = profile
        self._window = window
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._write_fd = -1
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pump: asyncio.Task[None] | None = None
        self._pipe: asyncio.ReadTransport | None = None
        self._session = ""
        self.requests: list[str] = []  # every URL the page asked for, in order

    async def __aenter__(self) -> Browser:
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        # the child's ends, moved above 9 so that putting them on 3 and 4 cannot clobber one
        r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 10)
        w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (to_chrome_r, from_chrome_w):
            os.close(fd)
        width, height = self._window
        self._profile.mkdir(parents=True, exist_ok=True)
        log = (self._profile / "chromium.log").open("wb")  # what it says when it will not start
        args = [
            "--headless",
            "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",  # no update or safe-browsing calls: loopback only
            "--disable-component-update",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # the protocol wants fds 3 and 4 exactly: a Python trampoline puts the pipes there
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _TRAMPOLINE,
            str(r),
            str(w),
            self._binary,
            *args,
            pass_fds=(r, w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        os.close(r)
        os.close(w)
        self._write_fd = to_chrome_w
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 << 20)  # a screenshot is one big message
        self._pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_chrome_r, "rb", 0)
        )
        self._reader = reader
        self._pump = asyncio.create_task(self._read_loop())
        try:
            # the first answer waits for the browser to start: on a loaded 2-core machine that
            # took over 15 s once, where it usually takes 1-3 s
            target = await self.command(
                "Target.createTarget", timeout_s=_START_TIMEOUT_S, url="about:blank"
            )
            attached = await self.command(
                "Target.attachToTarget", targetId=target["targetId"], flatten=True
            )
            self._session = attached["sessionId"]
            for domain in ("Page", "Runtime", "Network"):
                await self.command(f"{domain}.enable")
        except BaseException as error:
            # `async with` calls __aexit__ only after __aenter__ returns: without this, a
            # browser that fails to start outlives the test and its pipe is collected (and
            # warned about) during another one
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc = self._proc
        with contextlib.suppress(Exception):
            await self.command("Browser.close", timeout_s=5)
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        if self._pipe is not None:
            self._pipe.close()
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    async def _read_loop(self) -> None:
        assert self._reader is not None
        while True:
            try:
                raw = await self._reader.readuntil(b"\0")
            except asyncio.IncompleteReadError:
                break  # the browser is gone
            message = json.loads(raw[:-1])
            waiter = self._waiting.pop(message.get("id", -1), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
            elif message.get("method") == "Network.requestWillBeSent":
                self.requests.append(message["params"]["request"]["url"])
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(BrowserError(f"the browser exited: {self._log_tail()}"))

    def _log_tail(self) -> str:
        try:
            text = (self._profile / "chromium.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        lines = [line for line in text.splitlines() if "dbus" not in line]
        return " | ".join(lines[-5:])

    async def command(self, method: str, timeout_s: float = 15.0, **params: Any) -> dict[str, Any]:
        """Send one protocol command (to the page once attached) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self._session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self._session
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = waiter
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")  # small: never blocks
        try:
            answer = await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise BrowserError(
                f"{method}: no answer in {timeout_s} s; the browser's log ends: {self._log_tail()}"
            ) from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def navigate(self, url: str) -> None:
        """Open `url` in the page (the load may still be under way on return)."""
        await self.command("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = await self.command(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout_s: float = 15.0, what: str = "") -> Any:
        """Evaluate `expression` until it is truthy (a page mid-navigation is asked again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(BrowserError):
                value = await self.evaluate(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or expression}")
            await asyncio.sleep(0.05)

    async def cookies(self) -> list[dict[str, Any]]:
        """The cookies the browser holds for the page's URL."""
        found: list[dict[str, Any]] = (await self.command("Network.getCookies"))["cookies"]
        return found

    async def screenshot(self) -> bytes:
        """A PNG of the whole page."""
        shot = await self.command(
            "Page.captureScreenshot", format="png", captureBeyondViewport=True
        )
        return base64.b64decode(shot["data"])
