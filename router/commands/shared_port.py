"""The port the `--processes` children share (`router.commands.replicas`), held by their parent.

The children listen with SO_REUSEPORT, and Linux lets any socket of the same user that sets
it too join their group: a second `kvroute serve --processes N` (or `up --replicas N`) on a
busy port started, said it listened, and the kernel split new connections between two
unrelated routers. A single router's port is refused when taken ("cannot listen on ...:
Address already in use", exit 2); `hold_port` refuses it the same way, before any child
starts:

1. a probe socket without SO_REUSEPORT is bound to every address of the host: it fails if
   anything listens there, or if another parent holds the port (step 2's socket). The probe
   sets SO_REUSEADDR, as the children do: connections of a router stopped a moment ago
   (TIME_WAIT) must not keep the port from a new one, as they do not keep it from a single
   router;
2. the probe is closed and a socket with SO_REUSEPORT alone (not SO_REUSEADDR) is bound in its
   place, and kept, bound and not listening, until the children are gone. A child (restarted
   or not) joins it; a later parent's probe, or a single router, conflicts with it even while
   no child listens yet (starting, or all of them restarting).

Between step 1's close and step 2's bind, a parent started at the same instant could pass its
own probe too, and the two hold sockets would then share the port: the steps run under a lock
per port, an abstract Unix socket (Linux; released by the kernel when the process ends, however
it ends), held for those microseconds only. Another platform runs them without it.

A hold also keeps a claim of its port, another abstract Unix socket, for as long as it holds
it (Linux): a later parent, and a single router's check (`check_port`), are refused by it
whatever socket options its hold could use. That lets step 2 fall back, where Linux refuses
SO_REUSEPORT alone beside the TIME_WAIT of a listener without it (the connections of a single
router stopped a moment ago: step 1's probe passed, so nothing listens and no hold is there),
to a hold with SO_REUSEADDR as well, which that TIME_WAIT does not keep out. Before, `kvroute
serve --processes N` (or `up`) on the port a single `kvroute serve` had just left, after it
served a client, was refused for about a minute. Such a hold keeps out every kvroute router and
parent, but not another program that binds without SO_REUSEPORT while no child listens (then
the children say the port taken as they start); once a child listens, nothing without
SO_REUSEPORT can.

Port 0 draws a free port on the host's first address (a socket as step 1's, which keeps it
until the lock is taken), then runs steps 1 and 2 on that port for every address, drawing again
when another address has it taken. Before, only the first address was held (an IPv4 one: for
`""` or a name that resolves to 127.0.0.1 and ::1 too, [::]:P or [::1]:P was left to anyone).

`kvroute up` holds its router's port so, before its workers start, for one router (which then
listens with SO_REUSEPORT beside the hold) as for `--replicas`: before, a taken port was found
only once the workers, and the replicas' nats-server, were up and had printed how to reach them.

`listen.metrics_port` (and, under `--processes`, each child's metrics_port + i) is held the same
way (`hold_ports`, refused in the same words naming that key), and a metrics listener of a
process that listens beside a hold joins it: before, a taken metrics port was found once the
router, or the `--processes` children, `up`'s workers and nats-server, had started, and was said
in asyncio's words ("error while attempting to bind on address ('127.0.0.1', P): ...").

What still joins a held port is a program of this user that sets SO_REUSEPORT itself: the
kernel allows it, and nothing here can see it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import time
from collections.abc import Iterator

from router.errors import ConfigError

__all__ = ["PortHold", "hold_port", "hold_ports", "port_taken"]

_LOCK_WAIT_S = 2.0  # another parent holds the lock for microseconds: this is ample
_LOCK_RETRY_S = 0.005


class PortHold:
    """The sockets keeping a port for the children, and the port (the one drawn, for 0)."""

    def __init__(self, sockets: list[socket.socket], port: int) -> None:
        self._sockets = sockets
        self.port = port

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets = []


def hold_port(
    host: str,
    port: int,
    *,
    option: str = "serve --port",
    key: str = "listen.port",
    serving: str = "",
) -> PortHold:
    """Hold `port` on `host` for SO_REUSEPORT listeners of this process's children, or raise
    ConfigError, as a single router says it, when it is taken (module docstring); `option`,
    `key`, `serving`: as `port_taken` names them in the refusal."""
    try:
        if not port:
            return _draw(host)
        addresses = _addresses(host, port)
        with _locked(port):
            return _claimed_hold(port, addresses, addresses)
    except OSError as exc:
        raise port_taken(host, port, exc, option, key=key, serving=serving) from exc


def check_port(
    host: str, port: int, *, option: str, key: str = "listen.port", serving: str = ""
) -> None:
    """Refuse `port` on `host` (ConfigError, as `hold_port` words it) when one router, which
    binds it with asyncio's SO_REUSEADDR and no SO_REUSEPORT, could not: checked, not held. A
    hold binds with SO_REUSEPORT alone, which Linux refuses beside the TIME_WAIT of such a
    listener: a `kvroute serve` restarted on its port was refused for a minute after it had
    served a client (QA). A port a `--processes` parent holds is refused too (its claim:
    module docstring), though its hold may let this bind pass."""
    try:
        for family, address in _addresses(host, port):
            _bind(family, address, reuse_port=False).close()
        claim = _claim(port)
        if claim is not None:
            claim.close()
    except OSError as exc:
        raise port_taken(host, port, exc, option, key=key, serving=serving) from exc


def hold_ports(
    host: str, ports: list[int], *, option: str, key: str, serving: str = ""
) -> PortHold:
    """Hold every port of `ports` (none is 0) as `hold_port` holds one, or none of them
    (ConfigError: the first taken); the hold's `port` is the first."""
    held: list[socket.socket] = []
    try:
        for port in ports:
            one = hold_port(host, port, option=option, key=key, serving=serving)
            held += one._sockets
    except ConfigError:
        for sock in held:
            sock.close()
        raise
    return PortHold(held, ports[0])


def port_taken(
    host: str, port: int, exc: OSError, option: str, *, key: str = "listen.port", serving: str = ""
) -> ConfigError:
    """The refusal of a port that cannot be listened on, in one wording for one router and
    `--processes` alike: the OS's reason as it names it ("Address already in use"), never
    asyncio's rewording of it, and what `host` binds where it is `""`. `key`: the port's config
    key ([listen] port or metrics_port), `option`: what moves it (a command line's option, or
    the key itself where none does), `serving`: what was to listen there when it is not the
    router ("metrics")."""
    reason = exc.strerror or str(exc)
    if exc.errno and reason.startswith("error while attempting to bind"):
        reason = os.strerror(exc.errno)  # asyncio's: "...('127.0.0.1', P): address already..."
    served = f" for {serving}" if serving else ""
    return ConfigError(
        f"cannot listen on {_shown(host, port)}{served} ({reason}): choose another [listen] host "
        f"or {key.rpartition('.')[2]} ({option}), or stop what holds it",
        key=key,
    )


def _shown(host: str, port: int) -> str:
    """`host` and `port` as a refusal names them: `""` is every interface, IPv4 and IPv6 (it
    was shown as nothing, "cannot listen on :8000"), an IPv6 address is bracketed."""
    if not host:
        return f"0.0.0.0:{port} and [::]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_DRAW_TRIES = 20  # a drawn port taken on another address of the host: another draw


def _draw(host: str) -> PortHold:
    """A free port on every address of `host`, held (port 0)."""
    addresses = _addresses(host, 0)
    if not addresses:
        raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
    for _ in range(_DRAW_TRIES):
        family, (first, _) = addresses[0]
        probe = _bind(family, (first, 0), reuse_port=False)  # keeps the port until locked
        port = int(probe.getsockname()[1])
        on_port = [(f, (a, port)) for f, (a, _) in addresses]
        try:
            with _locked(port):
                probe.close()
                return _claimed_hold(port, on_port[1:], on_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        finally:
            probe.close()
    raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))


def _claimed_hold(
    port: int,
    probed: list[tuple[socket.AddressFamily, tuple[str, int]]],
    addresses: list[tuple[socket.AddressFamily, tuple[str, int]]],
) -> PortHold:
    """Under the port's lock: its claim, step 1's probe of each of `probed`, and step 2 on
    each of `addresses`; OSError, nothing kept, when one is refused."""
    claim = _claim(port)
    try:
        for family, address in probed:
            _bind(family, address, reuse_port=False).close()
        return PortHold(_hold_all(addresses, claim), port)
    except OSError:
        if claim is not None:
            claim.close()
        raise


def _hold_all(
    addresses: list[tuple[socket.AddressFamily, tuple[str, int]]], claim: socket.socket | None
) -> list[socket.socket]:
    """Step 2 on every address: the hold sockets (and `claim`, the port's claim, kept with
    them), or none (OSError) when one is refused. With a claim, a hold refused beside a
    TIME_WAIT binds with SO_REUSEADDR too (module docstring)."""
    try:
        held = _bind_all(addresses, reuse_address=False)
    except OSError as exc:
        if claim is None or exc.errno != errno.EADDRINUSE:
            raise
        held = _bind_all(addresses, reuse_address=True)
    return held if claim is None else [*held, claim]


def _bind_all(
    addresses: list[tuple[socket.AddressFamily, tuple[str, int]]], *, reuse_address: bool
) -> list[socket.socket]:
    held: list[socket.socket] = []
    try:
        for family, address in addresses:
            held.append(_bind(family, address, reuse_port=True, reuse_address=reuse_address))
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[str, int]]]:
    """Every address the children listen on, as asyncio's `create_server` finds them (`""`:
    every interface, IPv4 and IPv6; a name: each address it resolves to)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    found: list[tuple[socket.AddressFamily, tuple[str, int]]] = []
    for family, _, _, _, address in infos:
        entry = (family, (str(address[0]), int(address[1])))
        if family not in (socket.AF_INET, socket.AF_INET6) or entry in found:
            continue
        try:
            socket.socket(family, socket.SOCK_STREAM).close()
        except OSError:
            continue  # a family this host lacks (IPv6 off): asyncio skips it too
        found.append(entry)
    return found


def _bind(
    family: socket.AddressFamily,
    address: tuple[str, int],
    *,
    reuse_port: bool,
    reuse_address: bool = False,
) -> socket.socket:
    """A TCP socket bound to `address`, not listening: step 1's probe (SO_REUSEADDR), or step
    2's hold (SO_REUSEPORT, and `reuse_address` SO_REUSEADDR too)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            # as asyncio binds them: IPv6 only, so "::" and "0.0.0.0" are two sockets
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if reuse_address or not reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _claim(port: int) -> socket.socket | None:
    """The claim of `port` a hold keeps for its life (Linux; elsewhere None), or OSError
    (EADDRINUSE) when another process holds it (module docstring)."""
    if not sys.platform.startswith("linux"):
        return None
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0kvroute-held-port-{port}")
    except OSError:
        claim.close()
        raise
    return claim


@contextlib.contextmanager
def _locked(port: int) -> Iterator[None]:
    """Hold the lock of `port` among kvroute parents of this host (Linux; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                lock.bind(f"\0kvroute-shared-port-{port}")
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_LOCK_RETRY_S)
        yield
    finally:
        lock.close()
