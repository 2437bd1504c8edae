"""N router replica processes on one port: `kvroute serve --processes N`, `kvroute up --replicas N`.

One Python process runs one event loop on one core; N processes use N. Each child is a plain
`kvroute serve` listening with SO_REUSEPORT on the same port (the kernel spreads new
connections over them), and they are one router through the config's `[cluster]`: they share
decisions, fleet and admin state over NATS. This parent only starts them, says where they
listen, restarts one that dies (the others keep serving meanwhile), passes a reload on to all
of them (its own SIGHUP, or one child's `POST /admin/reload` through `reload_link`), and stops
them all on SIGINT or SIGTERM, each given the time a single router gives its requests in flight
(`SHUTDOWN_TIMEOUT_S`, and a margin) before it is killed, which is said. A restart that fails
(the config file broken since, a child that does not listen in time) is said and tried again
later, the wait doubling from 1 s to 30 s: a child's trouble is never the others'.

The children run in a session of their own (Ctrl-C in the terminal reaches this parent, which
stops them), and on Linux get SIGTERM when this parent dies, however it dies; a child whose
stop then does not end within `STOP_TIMEOUT_S` ends itself (`router.commands.orphan`). The parent's
SIGINT and SIGTERM handlers are up before the first child starts (`router.commands.stopping`):
one while they start stops those started so far.

A child runs what its siblings run, however often it is restarted: the parent hands each child,
on its stdin, the config it read at the start (with the command line's overrides), and the child
takes every restart-only key (`router.config_diff`: the tokenizer, the admin token, the
indexer, [cluster]...) from it, and the rest (live keys, workers) from the file as it reads it,
as a reload does; a file whose restart-only keys differ is said in one WARNING line naming them
(`router.commands.serve`). The siblings run those keys at their start values, as a reload keeps
them, so every child agrees on them until the whole router restarts. Before, a child restarted
after a crash started from the file as edited since: a changed `admin.token` was taken by one
process and not the others (the admin API answered 200 or 401 by connection), a changed
tokenizer or indexer setting had processes predicting differently, and a file a start refuses
(a tokenizer path that no longer exists) kept the child from coming back at all.

A reload reaches a child once it listens: one starting (or restarting) may have read the file
before the reload was asked for, so it is sent SIGHUP as soon as it listens (its handler is up
by then: signalled earlier, it died, and at first start the whole router with it). A SIGHUP to
this parent while it stops the children is said and ignored, as each child ignores one in its
grace (`router.commands.hangup`). Under `kvroute up --replicas` (`reload=False`) the file is
one `up` wrote: there is nothing to reload, as `up` says of its own SIGHUP.

The parent holds the port until the children are gone (`router.commands.shared_port`): a port
0 it draws, a port given it refuses when taken, as a single router does ("cannot listen on",
exit 2). Before, a second `serve --processes` on a busy port joined the first's SO_REUSEPORT
group, and the kernel split connections between two unrelated routers.

Metrics are per process (each counts the requests it served). Child i labels every series
`process="i"` (its index, kept across its restarts, so a restart reads as a counter reset of
its own series), and with `listen.metrics_port` P serves /metrics alone on P + i: one scrape
target per process. The shared port's /metrics answers from whichever child took the
connection, so a scrape of it sees one process's series at a time. The parent holds those ports
too, from before the first child starts (`hold_metrics`): a taken one is refused as a taken
router port is, where child i found it, said it in asyncio's words, and left the parent to say
"replica i exited before listening" once its siblings had started and joined the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import msgspec

from indexer.fingerprint import FINGERPRINT_KEY_ENV
from router.cluster.server import die_with_parent
from router.commands import hangup
from router.commands.serve import workers_said
from router.commands.shared_port import PortHold, hold_port, hold_ports
from router.config import RouterConfig
from router.errors import ConfigError
from router.http.listener import SHUTDOWN_TIMEOUT_S
from router.http.reload_link import ProcessesTold, answer_child
from router.http.start_checks import check_replicas

__all__ = ["STOP_TIMEOUT_S", "hold_metrics", "serve_processes"]

_START_TIMEOUT_S = 60.0
_PIPE = asyncio.subprocess.PIPE  # a child's stdin, when it is handed its siblings' config
_RESTART_DELAY_S = 1.0  # the first wait before restarting a child that exited
_RESTART_MAX_DELAY_S = 30.0  # the longest, after failed restarts or quick exits
_STABLE_S = 60.0  # a child that ran this long exited by accident, not in a loop: wait 1 s again
# a stopping child lets its requests run SHUTDOWN_TIMEOUT_S, then closes its cluster link and
# index: killed after 10 s, it cut long generations a single router lets finish. A child whose
# parent died ends itself after as long (`router.commands.orphan`)
_STOP_MARGIN_S = 15.0
STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S + _STOP_MARGIN_S


def _metrics_ports(config: RouterConfig, processes: int) -> list[int | None]:
    """The metrics port of each child (`listen.metrics_port` + its index), checked."""
    base = config.listen.metrics_port
    if base is None:
        return [None] * processes
    ports = list(range(base, base + processes))
    if ports[-1] > 65535 or config.listen.port in ports:
        raise ConfigError(
            f"listen.metrics_port {base}: {processes} processes serve metrics on ports "
            f"{base}-{base + processes - 1}, which must be below 65536 and must not hold "
            f"listen.port {config.listen.port}",
            key="listen.metrics_port",
        )
    return list(ports)


def hold_metrics(config: RouterConfig, processes: int) -> PortHold | None:
    """The metrics port of each of `processes` (one: the router's own, `listen.metrics_port`),
    checked and held until the caller closes the hold (None: no metrics port), or ConfigError
    naming `listen.metrics_port` when one is taken. The listeners of a `RouterService` started
    with `reuse_port` join it."""
    ports = [port for port in _metrics_ports(config, processes) if port is not None]
    if not ports:
        return None
    option = "listen.metrics_port"
    if processes > 1:
        option += f"; process i of {processes} serves metrics on it + i"
    return hold_ports(
        config.listen.host, ports, option=option, key="listen.metrics_port", serving="metrics"
    )


class _Child:
    """One replica process, the URL it reported, and its reload link (`reload_link`).

    `running`: the config its siblings run (MessagePack), written to its stdin at each start; None:
    none (its stdin is /dev/null)."""

    def __init__(
        self,
        index: int,
        cmd: list[str],
        env: dict[str, str],
        tell_others: Callable[[int], ProcessesTold] | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        running: bytes | None = None,
        tell_siblings: Callable[[int], ProcessesTold] | None = None,
    ) -> None:
        self.index = index
        # SIGHUP the children but this one, unsaid (`restarted`; None: no reload)
        self._tell_siblings = tell_siblings
        self.cmd = cmd
        self.env = env
        self.running = running
        # SIGHUP the children but this one (None: no reload, no link)
        self._tell_others = tell_others
        self.stop_timeout_s = stop_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.started_at = 0.0  # loop time of the last start
        self._link: asyncio.Task[None] | None = None
        # spawned and not listening yet: it may have read the config file, its SIGHUP handler
        # may not be up yet
        self._starting = False
        self._reload_due = False  # a reload asked for while starting: told once it listens

    def reload(self) -> Literal["told", "starting", "restarting"]:
        """Have this child read the config file again: "told" (SIGHUP sent), "starting" (sent
        once it listens), or "restarting" (not running, waiting to be restarted: it reads the
        file as it starts)."""
        if self._starting:
            self._reload_due = True
            return "starting"
        if self.url and self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGHUP)
                return "told"
        return "restarting"

    async def start(self) -> None:
        self.url = ""
        self.started_at = asyncio.get_running_loop().time()
        self._reload_due = False  # the new process reads the file after this
        self._starting = True
        try:
            await self._start()
        finally:
            self._starting = False
        if self._reload_due:
            self._reload_due = False
            _say(
                f"replica {self.index} listening: told to read the config again (SIGHUP), as "
                "asked while it started"
            )
            self.reload()

    def restarted(self) -> None:
        """It listens again after a crash, the file's live keys taken as it reads it now: the
        others read it too (SIGHUP), so one router runs one set (an edit not reloaded yet was
        the restarted child's alone: a salt limit refused by one process in two, QA).
        Nothing with reloads off: every child reads the file once, at its start."""
        if self._tell_siblings is None:
            return
        told = self._tell_siblings(self.index)
        _say(
            f"replica {self.index} restarted: {told.told} other replicas told to read the "
            "config again (SIGHUP), to run the live keys it took from the file"
        )

    async def _start(self) -> None:
        if self._link is not None:
            self._link.cancel()  # the last run's: that child is gone
        # the reload link: our end answered here, theirs passed as --reload-fd
        ours, theirs = socket.socketpair() if self._tell_others is not None else (None, None)
        cmd = self.cmd if theirs is None else [*self.cmd, "--reload-fd", str(theirs.fileno())]
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL if self.running is None else _PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=self.env,
                pass_fds=() if theirs is None else (theirs.fileno(),),
                preexec_fn=functools.partial(_in_child, os.getpid()),
                # out of the terminal's process group, as the nats-server: Ctrl-C reaches this
                # parent alone, which stops every child (SIGTERM). In the group, a child still
                # importing died of it with a KeyboardInterrupt traceback (its handler not up
                # yet; an ignored SIGINT is not kept across uvloop's spawn)
                start_new_session=True,
            )
        except BaseException:
            if ours is not None:
                ours.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()  # the child's now
        if ours is not None and self._tell_others is not None:
            tell, index = self._tell_others, self.index
            self._link = asyncio.get_running_loop().create_task(
                answer_child(ours, lambda: tell(index)), name=f"kvroute-reload-link-{index}"
            )
        assert self.proc.stdout is not None
        async with asyncio.timeout(_START_TIMEOUT_S):
            await self._hand_running()
            while not self.url:
                line = (await self.proc.stdout.readline()).decode(errors="replace")
                if not line:
                    raise ConfigError(f"replica {self.index} exited before listening")
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].split()[0]
        # the rest of its stdout is not ours to read: discard it so the pipe never fills
        asyncio.get_running_loop().create_task(self.proc.stdout.read())

    async def _hand_running(self) -> None:
        """Write the config its siblings run to the child's stdin, then close it (the child
        reads it whole before it starts)."""
        stdin = None if self.proc is None else self.proc.stdin
        if self.running is None or stdin is None:
            return
        # a child that died first says so by its stdout's end, read next
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(self.running)
            await stdin.drain()
        stdin.close()

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self.url = ""  # no reload for it any more
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                await proc.wait()
        except TimeoutError:
            _say(
                f"replica {self.index} did not stop within {self.stop_timeout_s:g} s of SIGTERM: "
                "killed (requests it still served were cut)"
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        finally:
            if self._link is not None:
                self._link.cancel()


def _in_child(parent: int) -> None:
    """In the child, before exec: on Linux it gets SIGTERM when this parent dies
    (`die_with_parent`). Its own exit check (`--exit-with-parent`) took the parent it first
    saw for the one to outlive, so a child whose parent was killed while it still imported saw
    its new parent (init, a subreaper) there and served on, orphaned, for good."""
    die_with_parent()
    if os.getppid() != parent:  # died before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _say(text: str) -> None:
    print(f"kvroute: {text}", file=sys.stderr, flush=True)


async def _keep(child: _Child) -> None:
    """Restart `child` each time it exits, until cancelled.

    A restart that fails is said and tried again, each wait twice the last up to
    `_RESTART_MAX_DELAY_S`; so is a child that exits again soon after a restart (a crash loop
    costs a start every 30 s at most). Raising here would stop every child, the healthy ones
    too: an operator mid-edit of the config file would take the whole router down."""
    loop = asyncio.get_running_loop()
    delay = _RESTART_DELAY_S
    while True:
        assert child.proc is not None
        code = await child.proc.wait()
        if loop.time() - child.started_at >= _STABLE_S:
            delay = _RESTART_DELAY_S
        _say(
            f"replica {child.index} exited ({code}); the others serve; restarting it in {delay:g} s"
        )
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESTART_MAX_DELAY_S)
            try:
                await child.start()
            except (ConfigError, TimeoutError, OSError) as exc:
                await child.stop()  # one that did not listen in time is still running
                _say(
                    f"replica {child.index} did not restart ({type(exc).__name__}: {exc}); the "
                    f"others serve; trying again in {delay:g} s"
                )
                continue
            child.restarted()
            break


async def serve_processes(
    config_path: str,
    config: RouterConfig,
    processes: int,
    *,
    log_level: str,
    until: Callable[[], Awaitable[None]],
    announce: Callable[[str], None] = print,
    verb: str = "serve",
    reload: bool = True,
    pointers: bool = False,
    overrides: Sequence[str] = (),
    port_given: bool = False,
    hold: PortHold | None = None,
    metrics_hold: PortHold | None = None,
) -> None:
    """Run `processes` replicas of the router of `config_path` until `until()` returns.

    `config` is that file's config with the command line's overrides, `overrides` those the
    operator gave of --host and --policy (flags and values), passed on to every child as
    given, and the port they share where the operator gave one (`port_given`): a child's
    reload reads the file through them, so a key one of them fixes is not the file's to
    change. (Every child was given all three: a reload of a file that moved
    listen.host off loopback with no admin token answered 200 and the next start refused it,
    a changed listen.port or policy.name was not even listed under needs_restart.) The port
    the children share is passed too where the file leaves it to the OS (0). `verb`: what each
    child runs, `serve` (the proxy) or `indexer` (the index and its query API only).
    `reload=False`: the file is read once (no reload by SIGHUP or `POST /admin/reload`;
    SIGHUP is left to the caller's handler). `hold`: the port held already, by a caller that
    holds it before it starts anything else (`kvroute up`, and `serve --processes` before
    its event loop); closed here as one held here is.
    `metrics_hold`: the children's metrics ports (`hold_metrics`), held already, alike.
    """
    cluster = check_replicas(config)  # as each child's reload checks its file
    env = dict(os.environ)
    if not config.admin.fingerprint_key and not env.get(FINGERPRINT_KEY_ENV):
        # one key for all: a namespace id one replica lists is the id another evicts by
        env[FINGERPRINT_KEY_ENV] = secrets.token_hex(32)
    metrics_ports = _metrics_ports(config, processes)
    if hold is None:  # ConfigError: taken
        hold = hold_port(config.listen.host, config.listen.port, option=f"{verb} --port")
    if metrics_hold is None:
        try:
            metrics_hold = hold_metrics(config, processes)  # ConfigError: one is taken
        except ConfigError:
            hold.close()
            raise
    port = hold.port
    # (a port 0, given or the file's, is the one reserved for them all)
    shared_port = ["--port", str(port)] if port_given or port != config.listen.port else []
    cmd = [
        sys.executable, "-m", "router.commands.cli", verb,
        "--config", config_path,
        *overrides,
        *shared_port,
        "--log-level", log_level,
        "--reuse-port",
        "--exit-with-parent",
        "--running-config-stdin",
        *([] if reload else ["--no-reload"]),
    ]  # fmt: skip
    # what every child runs of the restart-only keys, at a restart as at the start
    # (MessagePack: JSON has no infinity, which float settings such as timeouts.request_s take)
    running = msgspec.msgpack.encode(config)
    stopping = False  # SIGHUP is ignored from then on: the children are in their grace

    def tell(but: int | None = None) -> ProcessesTold:
        """Have every child but `but` read the file again. Each reloads it itself (its worker
        changes meet in the shared fleet); one starting is told once it listens."""
        outcomes = [] if stopping else [c.reload() for c in children if c.index != but]
        return ProcessesTold(
            count=processes,
            told=outcomes.count("told"),
            starting=outcomes.count("starting"),
            restarting=outcomes.count("restarting"),
        )

    def on_sighup() -> None:
        if stopping:
            _say("SIGHUP ignored: the replicas are stopping (each lets its requests finish)")
        else:
            tell()

    def reloaded(index: int) -> ProcessesTold:
        """Child `index` reloaded the file (`POST /admin/reload`): the others do too."""
        told = tell(but=index)
        starting = f", {told.starting} starting (told once listening)" if told.starting else ""
        restarting = (
            f", {told.restarting} restarting (reading it as it starts)" if told.restarting else ""
        )
        _say(
            f"replica {index} reloaded the config: {told.told} other replicas told to (SIGHUP)"
            + starting
            + restarting
        )
        return told

    children = [
        _Child(
            i,
            [
                *cmd,
                "--process-index",
                str(i),
                *(["--metrics-port", str(metrics_ports[i])] if metrics_ports[i] else []),
            ],
            env,
            reloaded if reload else None,
            running=running,
            tell_siblings=(lambda index: tell(but=index)) if reload else None,
        )
        for i in range(processes)
    ]

    if reload:
        hangup.install(asyncio.get_running_loop(), on_sighup)
    try:
        await asyncio.gather(*(child.start() for child in children))
        urls = {child.url for child in children}
        noun = "router" if verb == "serve" else "indexer"
        # one process is said as one (it said "1 router replica processes")
        processes_said = "process" if processes == 1 else "processes"
        announce(
            f"kvroute: {processes} {noun} replica {processes_said} listening on "
            f"{', '.join(sorted(urls))} (SO_REUSEPORT; {workers_said(config)}), one {noun} "
            f"through NATS at {', '.join(cluster.shown_servers)}"
        )
        if metrics_ports[0] is not None:
            host = next(iter(urls)).rsplit(":", 1)[0]
            announce(
                f"kvroute: metrics of each process (label process=0..{processes - 1}) on "
                + ", ".join(f"{host}:{p}/metrics" for p in metrics_ports)
            )
        else:
            announce(
                "kvroute: /metrics answers from one process per connection (its series "
                f"labelled process=0..{processes - 1}): set listen.metrics_port for a scrape "
                "target per process"
            )
        if pointers:  # `kvroute up`: what one router prints, under the replicas' one URL
            from router.commands.serve import router_pointers

            for line in router_pointers(min(urls), config):
                announce(line)
        sys.stdout.flush()
        async with asyncio.TaskGroup() as group:
            keepers = [group.create_task(_keep(child)) for child in children]
            await until()
            stopping = True
            # (`up --relay` runs one: "the 1 replicas" was said)
            them = "the replica" if processes == 1 else f"the {processes} replicas"
            _say(
                f"stopping {them} (SIGTERM): each lets its requests in flight finish, for up "
                f"to {children[0].stop_timeout_s:g} s"
            )
            for keeper in keepers:
                keeper.cancel()
    finally:
        stopping = True  # SIGHUP's handler stays: removed, its default would end this process
        await asyncio.gather(*(child.stop() for child in children))
        hold.close()
        if metrics_hold is not None:
            metrics_hold.close()
