"""N router replica processes on one port: `kvroute serve --processes N`, `kvroute up --replicas N`.

One Python process runs one event loop on one core; N processes use N. Each child is a plain
`kvroute serve` listening with SO_REUSEPORT on the same port (the kernel spreads new
connections over them), and they are one router through the config's `[cluster]`: they share
decisions, fleet and admin state over NATS. This parent only starts them, says where they
listen, restarts one that dies (the others keep serving meanwhile), and stops them all on
SIGINT or SIGTERM.

With port 0 the parent picks the port: it binds (without listening) a SO_REUSEPORT socket on
port 0 and keeps it until the children are gone, so the port stays theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from indexer.fingerprint import FINGERPRINT_KEY_ENV
from router.config import RouterConfig
from router.errors import ConfigError

__all__ = ["serve_processes"]

_START_TIMEOUT_S = 60.0
_RESTART_DELAY_S = 1.0


def _reserve(host: str, port: int) -> tuple[socket.socket | None, int]:
    """(the socket keeping the port, the port): a free port when `port` is 0."""
    if port:
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock, int(sock.getsockname()[1])


class _Child:
    """One replica process and the URL it reported."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str]) -> None:
        self.index = index
        self.cmd = cmd
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=self.env,
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not self.url:
                line = (await self.proc.stdout.readline()).decode(errors="replace")
                if not line:
                    raise ConfigError(f"replica {self.index} exited before listening")
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].split()[0]
        # the rest of its stdout is not ours to read: discard it so the pipe never fills
        asyncio.get_running_loop().create_task(self.proc.stdout.read())

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(10.0):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _none(waited: Awaitable[None]) -> int | None:
    await waited
    return None


async def serve_processes(
    config_path: str,
    config: RouterConfig,
    processes: int,
    *,
    log_level: str,
    until: Callable[[], Awaitable[None]],
    announce: Callable[[str], None] = print,
    verb: str = "serve",
) -> None:
    """Run `processes` replicas of the router of `config_path` until `until()` returns.

    `config` is that file's config with the command line's overrides (host, port, policy),
    which are passed on to every child. `verb`: what each child runs, `serve` (the proxy) or
    `indexer` (the index and its query API only).
    """
    if config.cluster is None:
        raise ConfigError(
            "several replica processes need a [cluster] section (the NATS they agree through; "
            "kvroute up --replicas N starts one)",
            key="cluster",
        )
    if config.cluster.replica_id:
        # every child reads the one file: under one id, each would drop the others'
        # decisions and admin changes as its own
        raise ConfigError(
            f"cluster.replica_id {config.cluster.replica_id!r} names one process: with "
            "several, leave it out (each replica draws its own)",
            key="cluster.replica_id",
        )
    env = dict(os.environ)
    if not config.admin.fingerprint_key and not env.get(FINGERPRINT_KEY_ENV):
        # one key for all: a namespace id one replica lists is the id another evicts by
        env[FINGERPRINT_KEY_ENV] = secrets.token_hex(32)
    holder, port = _reserve(config.listen.host, config.listen.port)
    cmd = [
        sys.executable, "-m", "router.commands.cli", verb,
        "--config", config_path,
        "--host", config.listen.host,
        "--port", str(port),
        "--policy", config.policy.name,
        "--log-level", log_level,
        "--reuse-port",
        "--exit-with-parent",
    ]  # fmt: skip
    children = [_Child(i, cmd, env) for i in range(processes)]

    def hangup() -> None:
        # every replica reloads the file itself (its worker changes meet in the shared fleet)
        for child in children:
            if child.proc is not None and child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGHUP)

    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        await asyncio.gather(*(child.start() for child in children))
        urls = {child.url for child in children}
        announce(
            f"kvroute: {processes} {'router' if verb == 'serve' else 'indexer'} replica processes "
            f"listening on {', '.join(sorted(urls))}"
            f" (SO_REUSEPORT), one router through NATS at {', '.join(config.cluster.servers)}"
        )
        sys.stdout.flush()
        stopping: asyncio.Future[int | None] = asyncio.ensure_future(_none(until()))
        while not stopping.done():
            waits: dict[asyncio.Future[int | None], _Child] = {
                asyncio.ensure_future(c.proc.wait()): c for c in children if c.proc
            }
            done, _ = await asyncio.wait(
                [stopping, *waits], return_when=asyncio.FIRST_COMPLETED
            )  # fmt: skip
            for fut, child in waits.items():
                if fut not in done:
                    fut.cancel()
                elif not stopping.done():
                    print(
                        f"kvroute: replica {child.index} exited ({fut.result()}); the others "
                        f"serve; restarting it in {_RESTART_DELAY_S:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    await asyncio.sleep(_RESTART_DELAY_S)
                    child.url = ""
                    await child.start()
    finally:
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGHUP)
        await asyncio.gather(*(child.stop() for child in children))
        if holder is not None:
            holder.close()
