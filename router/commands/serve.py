"""`kvroute serve --config FILE`: the router in front of an existing fleet.

The router itself (aiohttp, the indexer's ZMQ subscribers) is imported when it starts, so the
verb's arguments load light (`kvroute serve --help`, and `kvroute up` reusing them). SIGHUP
reloads the config file (`router.http.reload`) and logs one line saying what changed; one that
comes while the router starts reloads it once the router is up, and one in the shutdown grace is
said and ignored (`router.commands.hangup`: never the default action, which ends the process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, get_args

import msgspec

from router.commands import hangup
from router.commands.collector_settings import settle_collector
from router.config import (
    PolicyName,
    RouterConfig,
    WorkerConfig,
    load_config,
    parse_config,
    read_config_file,
)
from router.errors import ConfigError

if TYPE_CHECKING:
    from router.http.reload import ConfigSource
    from router.service import RouterService

__all__ = [
    "EVENT_LOOP_ENV",
    "LOG_LEVELS",
    "add_arguments",
    "apply_overrides",
    "as_siblings_run",
    "config_source",
    "configure_logging",
    "curl_example",
    "read_config",
    "run",
    "run_loop",
    "serve_fleet",
    "serve_until_stopped",
    "tcp_port",
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port to listen on, 0 to 65535 (0: any free one). A value past
    it is refused by name; handed on unchecked, the socket took it modulo 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    routes: bool = True,
    processes: bool = True,
    runs: str = "router",
) -> None:
    """Options of `kvroute serve`; `routes=False`: no --policy (a verb that scores no
    worker), `processes=False`: no --processes (a verb that must run as one process), `runs`:
    what the verb's processes are together, in --processes' help ("router", "indexer")."""
    parser.add_argument("--config", required=True, help="router TOML config (see configs/)")
    parser.add_argument("--host", help="override listen.host")
    parser.add_argument("--port", type=tcp_port, help="override listen.port (0 = any free port)")
    if routes:
        parser.add_argument(
            "--policy",
            choices=get_args(PolicyName),
            help="override policy.name",
        )
    parser.add_argument(
        "--log-level",
        type=str.upper,  # logging knows only upper-case names; `debug` is as good
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)}, in any case (default %(default)s)",
    )
    if processes:
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            help=f"replica processes on the one port (SO_REUSEPORT), one {runs} through the "
            "config's [cluster] (default %(default)s)",
        )
    # a replica started by --processes: listen with SO_REUSEPORT beside its siblings
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    # ...and stop when that parent is gone, even if it was killed with no chance to say so
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    # ...which it is process i of: `process` label on its series, metrics on its own port
    parser.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=tcp_port, help=argparse.SUPPRESS)
    # ...and whose end of the link to that parent is this descriptor (`reload_link`)
    parser.add_argument("--reload-fd", type=int, help=argparse.SUPPRESS)
    # ...or, under `kvroute up --replicas`, whose file `up` wrote once: no reload (as `up`)
    parser.add_argument("--no-reload", action="store_true", help=argparse.SUPPRESS)
    # ...and whose restart-only keys are those of the config its parent writes to its stdin,
    # what its siblings run (`router.commands.replicas`), whatever its file says since
    parser.add_argument("--running-config-stdin", action="store_true", help=argparse.SUPPRESS)


def apply_overrides(config: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    """The config with the command line's --host/--port/--policy applied."""
    listen = config.listen
    if getattr(args, "host", None):
        listen = msgspec.structs.replace(listen, host=args.host)
    if getattr(args, "port", None) is not None:
        listen = msgspec.structs.replace(listen, port=args.port)
    if getattr(args, "metrics_port", None) is not None:
        listen = msgspec.structs.replace(listen, metrics_port=args.metrics_port)
    policy = config.policy
    if getattr(args, "policy", None):
        policy = msgspec.structs.replace(policy, name=args.policy)
    return msgspec.structs.replace(config, listen=listen, policy=policy)


def given_overrides(args: argparse.Namespace) -> list[str]:
    """The --host and --policy the operator gave (`apply_overrides`'), as flags (a --port
    given is the port the children share, which `serve_processes` passes itself)."""
    flags: list[str] = []
    if getattr(args, "host", None):
        flags += ["--host", args.host]
    if getattr(args, "policy", None):
        flags += ["--policy", args.policy]
    return flags


async def serve_until_stopped(
    config: RouterConfig,
    *,
    announce: bool = True,
    reuse_port: bool = False,
    exit_with_parent: bool = False,
    proxy: bool = True,
    config_source: ConfigSource | None = None,
    process: int | None = None,
    relay: bool = False,
    reload_fd: int | None = None,
) -> None:
    """Run the router until SIGINT or SIGTERM, then shut down cleanly; SIGHUP reloads
    `config_source` (the file `config` came from).

    `proxy=False` runs the index and its APIs without the generation endpoints
    (`kvroute indexer`). `process`: which replica process of `--processes` this is, and
    `reload_fd` its link to the parent, through which `POST /admin/reload` reaches the others."""
    from indexer.backend import DEFAULT as INDEX_BACKEND
    from router.http.keys import RELOADER
    from router.http.listener import SHUTDOWN_TIMEOUT_S
    from router.http.reload_link import ReloadLink
    from router.service import RouterService

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    log = logging.getLogger(__name__)

    def on_stop(sig: signal.Signals) -> None:
        """The first SIGINT or SIGTERM stops the router, said in one line (before, nothing
        was said while its requests in flight ran on, up to a minute); any later one is
        ignored, silently, as before."""
        if not stop.is_set():
            log.info(
                "%s: stopping: requests in flight are let finish, for up to %g s",
                sig.name,
                SHUTDOWN_TIMEOUT_S,
            )
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_stop, sig)
    started: RouterService | None = None  # the router, once up
    asked_early = False  # a reload asked for while the router was starting
    reloads: set[asyncio.Task[None]] = set()

    def on_sighup() -> None:
        """SIGHUP, from before the router starts until the process exits: never its default
        action (`router.commands.hangup`), which would cut the requests of a shutdown grace."""
        nonlocal asked_early
        if stop.is_set():
            log.warning("SIGHUP ignored: shutting down (the config file is not read again)")
        elif config_source is None:
            log.warning(
                "SIGHUP ignored: this router has no config file of its own to read again "
                "(kvroute up wrote it once for its replicas)"
            )
        elif started is None:
            asked_early = True
            log.info("SIGHUP while starting: the config file is read again once the router is up")
        else:
            task = loop.create_task(_reload(started), name="kvroute-sighup")
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    hangup.install(loop, on_sighup)
    if exit_with_parent:
        from router.commands.orphan import watch_parent
        from router.commands.replicas import STOP_TIMEOUT_S

        # a stop that does not end by itself is ended after the grace the parent would give
        watch_parent(lambda: _set_from_thread(loop, stop), STOP_TIMEOUT_S)
    verb = "relay" if relay else "serve" if proxy else "indexer"
    async with listening(
        RouterService(
            config,
            reuse_port=reuse_port,
            proxy=proxy,
            config_source=config_source,
            process=process,
            relay=relay,
        ),
        f"{verb} --port",
    ) as router:
        started = router
        link = ReloadLink(reload_fd) if reload_fd is not None else None
        if link is not None:
            router.app[RELOADER].siblings = link.tell_siblings
        if asked_early and not stop.is_set():
            on_sighup()  # the file may have changed after this process read it
        settle_collector()
        if announce:
            query = "POST /v1/kv/query" if config.query.enabled else "query API off"
            what = "router" if proxy else f"indexer (no proxy; {query})"
            if relay and config.cluster is not None:
                servers = ", ".join(config.cluster.shown_servers)
                what = (
                    f"relay (KV events to {servers}, stream {config.cluster.subject_prefix}_events)"
                )
            # the URL first, as tools read it (the first word after "listening on"); a
            # wildcard host is said beside it (before, 0.0.0.0 read as 127.0.0.1 only)
            bound = router.wildcard_bind
            where = (
                f"all interfaces, bound to {bound}: {router.url} from this host; " if bound else ""
            )
            # the relay routes nothing (and refuses --policy): no policy said (it said one)
            policy = "" if relay else f"policy {config.policy.name}, "
            # how many workers, as `up` says it: an empty fleet was not said at all
            lines = [
                f"kvroute {what} listening on {router.url} ({where}{policy}"
                f"{workers_said(config)}, index core {INDEX_BACKEND.name})"
            ]
            if router.metrics_url:
                also = " (all interfaces)" if bound else ""
                lines.append(f"kvroute metrics on {router.metrics_url}{also}")
            _announce(lines)
        await stop.wait()  # SIGHUP is ignored from here on, said in one line
        if link is not None:
            link.close()


def workers_said(config: RouterConfig) -> str:
    """ "1 worker", "3 workers": the workers of `config`, said in a start line."""
    count = len(config.workers)
    return f"{count} worker{'' if count == 1 else 's'}"


def _announce(lines: list[str]) -> None:
    """Print `lines` on stdout; a pipe nobody reads any more (`kvroute serve | head -0`, or
    a `--processes` child whose parent died: its exit check ends it) is let go quietly. Before,
    BrokenPipeError ended the router with a traceback before it served."""
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        # stdout onto /dev/null: the interpreter's own flush at exit would raise it again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


async def _reload(router: RouterService) -> None:
    """A SIGHUP: reload (the reloader logs the one line: what changed, or the bad key).

    Anything else a reload raises is a defect, logged here once with its traceback: nobody
    awaits this task, so it escaped as asyncio's "Task exception was never retrieved" (a
    RecursionError from a deeply nested file did, before it was refused as a ConfigError)."""
    try:
        await router.reload()
    except ConfigError:
        pass  # logged by the reloader, naming the key
    except Exception:
        logging.getLogger(__name__).exception("config reload on SIGHUP failed")


def _set_from_thread(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set `event` of `loop` from another thread; once the loop is closed, nothing is left to
    stop."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(event.set)


def read_config(path: str, *, reloading: bool = False) -> RouterConfig:
    """A TOML config file, or the JSON one `kvroute up --replicas` writes for its replicas
    (read once, a regular file of bounded size; `reloading`: an empty one is refused,
    `router.config.read_config_file`)."""
    if path.endswith(".json"):
        raw = read_config_file(path, reloading=reloading)
        try:
            data = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        except RecursionError as exc:  # as a TOML file's (`router.config._parse_toml`)
            raise ConfigError(f"{path}: JSON nests too deep to read: is this the config?") from exc
        return parse_config(data, source=path)
    return load_config(path, reloading=reloading)


def as_siblings_run(config: RouterConfig, running: bytes, args: argparse.Namespace) -> RouterConfig:
    """`config` (a `--processes` child's file) with every restart-only key at its value in
    `running` (the config its parent wrote to its stdin, MessagePack: what its siblings run), its
    live keys and workers as the file has them, as a reload would take them. The keys whose
    file value is not applied are said in one WARNING line.

    Before, a child restarted after a crash ran the file as edited since: an `admin.token`
    changed there was taken by it alone (the admin API answered 200 or 401 by connection), a
    changed `[tokenizer]` or `[indexer]` had processes of one router predict otherwise."""
    from router.config_diff import diff_configs

    try:
        data = msgspec.msgpack.decode(running)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"the config on stdin (--running-config-stdin): {exc}") from exc
    siblings = apply_overrides(parse_config(data, source="the parent's config"), args)
    from router.http.start_checks import StartChecks

    try:
        # as the others' reload of this file judges it (they are told to read it once this
        # process listens): one they refuse is not this one's to take a part of either
        StartChecks(replicas=True).reload(config, siblings)
    except ConfigError as exc:
        logging.getLogger(__name__).warning(
            "%s: refused as a reload refuses it (%s): this process runs what the other replica "
            "processes run, live keys and workers included, until a reload of a fixed file",
            args.config,
            exc,
        )
        return siblings
    config, diff = diff_configs(siblings, config)
    if diff.needs_restart:
        logging.getLogger(__name__).warning(
            "%s: %s differ%s from what the other replica processes run: kept at their value "
            "(restart the whole router, the parent, to apply them)",
            args.config,
            ", ".join(diff.needs_restart),
            "s" if len(diff.needs_restart) == 1 else "",
        )
    return config


def config_source(args: argparse.Namespace) -> ConfigSource:
    """What a reload reads: `args.config` again, with the same overrides (a --port stays the
    port), read once and an empty file refused (`read_config(..., reloading=True)`)."""
    from router.http.reload import ConfigSource

    path: str = args.config
    return ConfigSource(path, lambda: apply_overrides(read_config(path, reloading=True), args))


def curl_example(url: str, model: str = "kvroute/reference-byte-lm") -> str:
    """A copy-pasteable request through the router at `url`."""
    body = msgspec.json.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
            "cache_salt": "tenant-a",
        }
    ).decode()
    return (
        f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"     -d '{body}'"
    )


async def serve_fleet(
    config: RouterConfig,
    workers: Sequence[WorkerConfig],
    until: Callable[[], Awaitable[None]],
    *,
    reuse_port: bool = False,
) -> None:
    """Run the router of `config` in front of `workers` (added to its own) until `until()`.

    `kvroute up` calls this once its reference workers are up; it prints the router URL, a
    curl example, where the admin API is and the dashboard. `reuse_port`: listen beside the
    socket `up` holds the port with from before its workers start (`shared_port.hold_port`).
    """
    from router.service import RouterService

    config = msgspec.structs.replace(config, workers=(*config.workers, *workers))
    async with listening(
        RouterService(config, reuse_port=reuse_port), "up --router-port"
    ) as router:
        settle_collector()
        count = len(config.workers)
        print(
            f"\nkvroute router: {router.url}  (policy {config.policy.name}, "
            f"{count} worker{'' if count == 1 else 's'})"
        )
        for line in router_pointers(router.url, config):
            print(line)
        sys.stdout.flush()
        await until()


@contextlib.asynccontextmanager
async def listening(service: RouterService, option: str) -> AsyncIterator[RouterService]:
    """`service`, started and stopped; a port it cannot listen on refused as `hold_port`
    refuses it (`shared_port.port_taken`: one wording for one router and `--processes`, the
    option of this command that moves it). Before, one router said asyncio's "error while
    attempting to bind on address ('127.0.0.1', P): address already in use", `--processes`
    "Address already in use", and `kvroute indexer` was told of "serve --port, up
    --router-port". A taken `listen.metrics_port` is refused in the same words, naming that key
    (it said asyncio's, "cannot serve metrics on ... (error while attempting to bind ...)")."""
    from router.commands.shared_port import port_taken

    async with contextlib.AsyncExitStack() as stack:
        try:
            started = await stack.enter_async_context(service)
        except ConfigError as exc:
            cause = exc.__cause__
            if not isinstance(cause, OSError):
                raise
            listen = service.config.listen
            if exc.key == "listen.port":
                raise port_taken(listen.host, listen.port, cause, option) from cause
            if exc.key == "listen.metrics_port" and listen.metrics_port is not None:
                raise port_taken(
                    listen.host,
                    listen.metrics_port,
                    cause,
                    "listen.metrics_port",
                    key=exc.key,
                    serving="metrics",
                ) from cause
            raise
        yield started


def router_pointers(url: str, config: RouterConfig) -> list[str]:
    """What `kvroute up` prints under the router's URL: a request to try through it, where
    the admin API and the dashboard are, how to stop (one router or its replicas alike)."""
    lines = ["try, through the router:", curl_example(url)]
    auth = ' -H "Authorization: Bearer $TOKEN"' if config.admin_token() else ""
    if config.admin.enabled:
        lines.append(f"admin:  curl -s{auth} {url}/admin/workers")
        lines.append(f"dashboard: {url}/dashboard (in a browser)")
    lines.append("Ctrl-C stops the router and every worker.")
    return lines


EVENT_LOOP_ENV = "KVROUTE_EVENT_LOOP"


def run_loop(main: Coroutine[object, object, None]) -> None:
    """Run `main` on uvloop when it is installed (the default), or on asyncio's own loop when
    $KVROUTE_EVENT_LOOP is "asyncio" (or uvloop is missing: Windows, a trimmed install).

    uvloop served 1.12-1.31x the requests/s of asyncio's loop on the proxy hot path
    (`kvroute bench proxy`, docs/benchmarks/proxy.md), and passes the serve tests (the idle
    flood under a low descriptor limit included, tests/router/commands/
    test_router_serve_cli.py) and a soak with a worker restart (docs/benchmarks/soak_uvloop/).
    ConfigError for another value of the variable.
    """
    wanted = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    name = "asyncio"
    try:
        if wanted not in ("", "uvloop", "asyncio"):
            raise ConfigError(f"{EVENT_LOOP_ENV}={wanted!r}: use uvloop or asyncio")
        if wanted != "asyncio":
            try:
                import uvloop
            except ImportError:
                if wanted == "uvloop":  # asked for by name: say what is missing
                    raise ConfigError(
                        f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed (pip install uvloop)"
                    ) from None
            else:
                factory, name = uvloop.new_event_loop, "uvloop"
    except ConfigError:
        main.close()  # never run: no "coroutine was never awaited" warning beside the error
        raise
    logging.getLogger(__name__).info("event loop: %s", name)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main)
    finally:
        # closing the loop gave SIGHUP its default action back: it would end the process
        # mid-exit
        hangup.ignore()


def configure_logging(level: str, process: int | None = None) -> None:
    """Log lines with the request each one was written for (`x-request-id`, "-" outside),
    and under `--processes` the process that wrote it (`process=i`, its metrics label): the
    children share the parent's stderr, and three alike "config reload refused" lines said
    nothing of which process refused."""
    from router.http.observe import install_log_request_id

    install_log_request_id()
    who = "" if process is None else f"process={process} "
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {who}%(name)s [%(request_id)s]: %(message)s",
    )


def _warn_fleet_table(path: str, config: RouterConfig, verb: str) -> None:
    """Say that `[fleet]` starts nothing here (once: not again by each --processes child).

    configs/local.toml is `kvroute up`'s: served as it is, it gave a router of no workers whose
    every request was a 503, and nothing said why."""
    workers = len(config.workers)
    log = logging.getLogger(__name__)
    log.warning(
        "%s has a [fleet] table: only `kvroute up --config %s` starts those workers; "
        "`kvroute %s` routes to the config's [[workers]] (%d%s)",
        path,
        path,
        verb,
        workers,
        ": every request is a 503 until workers are added through the admin API"
        if not workers
        else "",
    )


def _warn_no_workers(path: str, config: RouterConfig, proxy: bool) -> None:
    """Say that the config lists no worker (once: not again by each --processes child), what
    that means, and how workers come. Before, the router started as for any fleet and said
    nothing: every request a 503, and no line said why."""
    cluster = ", or another replica of its [cluster]" if config.cluster is not None else ""
    meanwhile = "the index stays empty" if not proxy else "every request is a 503"
    logging.getLogger(__name__).warning(
        "%s lists no [[workers]]: %s until workers are added (POST /admin/workers, a reload of "
        "the file%s)",
        path,
        meanwhile,
        cluster,
    )


def _check_ports(config: RouterConfig, verb: str) -> None:
    """Refuse a taken `listen.port` or `listen.metrics_port` before anything starts, in the
    words `listening` says it in (ConfigError). The service binds them after its startup (a
    NATS connection, a snapshot's load, the workers' discovery: seconds): before, a taken port
    was said only then, under the startup's log lines. (Checked as the service binds them,
    not held: one process listens without SO_REUSEPORT, as it always did.)"""
    from router.commands.shared_port import check_port

    listen = config.listen
    if listen.port:
        check_port(listen.host, listen.port, option=f"{verb} --port")
    if listen.metrics_port:
        check_port(
            listen.host,
            listen.metrics_port,
            option="listen.metrics_port",
            key="listen.metrics_port",
            serving="metrics",
        )


def run(args: argparse.Namespace, *, proxy: bool = True, relay: bool = False) -> int:
    """Load the config and serve until interrupted."""
    configure_logging(args.log_level, getattr(args, "process_index", None))
    from router.http.memory import TRACEMALLOC_ENV, start_tracing

    if start_tracing():  # before the router allocates anything (see /admin/debug/memory)
        logging.getLogger(__name__).warning(
            "%s is set: tracemalloc traces every allocation (slower)", TRACEMALLOC_ENV
        )
    processes = getattr(args, "processes", 1)
    if processes < 1:
        # as argparse would say it (the workers' `at_least` type, which serve may not import)
        print(
            f"kvroute serve: argument --processes: must be at least 1, got {processes}",
            file=sys.stderr,
        )
        return 2
    try:
        config = apply_overrides(read_config(args.config), args)
        if getattr(args, "running_config_stdin", False):
            config = as_siblings_run(config, sys.stdin.buffer.read(), args)
        if getattr(args, "reuse_port", False):
            pass  # a --processes child: its parent said what there was to say of the file
        elif config.fleet is not None:
            _warn_fleet_table(args.config, config, "serve" if proxy else "indexer")
        elif not config.workers:
            _warn_no_workers(args.config, config, proxy)
        source = None if getattr(args, "no_reload", False) else config_source(args)
        if processes > 1:
            from router.commands.replicas import hold_metrics, serve_processes
            from router.commands.shared_port import hold_port
            from router.commands.stopping import stoppable
            from router.http.start_checks import check_replicas

            verb = "serve" if proxy else "indexer"  # children without the proxy too
            # refused (a cluster missing, a port taken) in one line, before the event loop
            # says itself: before, "event loop: uvloop" came first
            check_replicas(config)
            hold = hold_port(config.listen.host, config.listen.port, option=f"{verb} --port")
            try:
                metrics_hold = hold_metrics(config, processes)
            except ConfigError:
                hold.close()
                raise
            # SIGINT and SIGTERM handled before the first child starts
            run_loop(
                stoppable(
                    lambda until: serve_processes(
                        args.config,
                        config,
                        processes,
                        log_level=args.log_level,
                        until=until,
                        verb=verb,
                        overrides=given_overrides(args),
                        port_given=getattr(args, "port", None) is not None,
                        hold=hold,
                        metrics_hold=metrics_hold,
                    )
                )
            )
        else:
            if not getattr(args, "reuse_port", False):  # (a child: its parent holds them)
                _check_ports(config, "relay" if relay else "serve" if proxy else "indexer")
            run_loop(
                serve_until_stopped(
                    config,
                    reuse_port=getattr(args, "reuse_port", False),
                    exit_with_parent=getattr(args, "exit_with_parent", False),
                    proxy=proxy,
                    config_source=source,
                    process=getattr(args, "process_index", None),
                    relay=relay,
                    reload_fd=getattr(args, "reload_fd", None),
                )
            )
    except ConfigError as exc:
        verb = "relay" if relay else "serve" if proxy else "indexer"
        print(f"kvroute {verb}: {exc}", file=sys.stderr)
        return 2
    return 0
