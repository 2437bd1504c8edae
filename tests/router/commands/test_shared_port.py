"""`hold_port`: the port of `--processes` children, refused when taken, held against others."""

from __future__ import annotations

import socket
import threading

import pytest

from router.commands.shared_port import PortHold, check_port, hold_port, hold_ports
from router.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_listener(port: int, *, reuse_port: bool = True) -> socket.socket:
    """A socket as a child (or, `reuse_port=False`, a single router) listens: asyncio's
    SO_REUSEADDR, and SO_REUSEPORT beside its siblings."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def test_a_held_port_takes_the_children_and_refuses_everyone_else() -> None:
    port = _free_port()
    hold = hold_port("127.0.0.1", port)
    try:
        assert hold.port == port
        # before any child listens, a second parent is refused (before: it joined)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}") as caught:
            hold_port("127.0.0.1", port)
        assert caught.value.key == "listen.port"
        with pytest.raises(OSError):  # a single router too
            _child_listener(port, reuse_port=False)
        first = _child_listener(port)
        second = _child_listener(port)  # the children share it
        first.close()
        _child_listener(port).close()  # a child restarted while its sibling serves
        second.close()
        _child_listener(port).close()  # ...or while none does: the hold kept the port
        with pytest.raises(ConfigError):
            hold_port("127.0.0.1", port)
    finally:
        hold.close()
    hold_port("127.0.0.1", port).close()  # released


def test_a_port_something_listens_on_is_refused() -> None:
    port = _free_port()
    for reuse_port in (False, True):  # a single router, or another parent's child
        with (
            _child_listener(port, reuse_port=reuse_port),
            pytest.raises(ConfigError, match="Address already in use"),
        ):
            hold_port("127.0.0.1", port)


@pytest.mark.parametrize("reuse_port", [True, False], ids=["children", "one-router"])
def test_connections_of_a_router_just_stopped_do_not_keep_the_port(reuse_port: bool) -> None:
    """Server-side closes leave TIME_WAIT on the port: a single router takes it back
    (SO_REUSEADDR: its check passes), and so do the children. Linux refuses a bind with
    SO_REUSEPORT alone, a hold's, beside the TIME_WAIT of a listener without it (a single
    router's): its check held the port, and a `kvroute serve` restarted on its port was
    refused for a minute after it had served a client (QA)."""
    port = _free_port()
    _serve_one_connection(port, reuse_port=reuse_port)
    check_port("127.0.0.1", port, option="serve --port")
    hold_port("127.0.0.1", port).close()


def _serve_one_connection(port: int, *, reuse_port: bool) -> None:
    """A router on `port` served a client and stopped, closing first: its side of the
    connection waits in TIME_WAIT on the port."""
    with (
        _child_listener(port, reuse_port=reuse_port) as listener,
        socket.create_connection(("127.0.0.1", port)) as client,
    ):
        accepted, _ = listener.accept()
        accepted.close()  # the server closes first: its side waits
        client.recv(1)


def test_a_port_a_single_router_just_left_is_held_and_kept_from_every_kvroute() -> None:
    """`serve --processes N` on the port a single router left a moment ago: Linux refuses
    SO_REUSEPORT alone beside the TIME_WAIT of its connections, so the hold binds with
    SO_REUSEADDR too (before: refused for a minute, "Address already in use"). The port's
    claim keeps it all the same from another parent and from a single router's check, and
    the children share it."""
    port = _free_port()
    _serve_one_connection(port, reuse_port=False)
    with socket.socket() as strict, pytest.raises(OSError):  # what the hold met before
        strict.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        strict.bind(("127.0.0.1", port))
    hold = hold_port("127.0.0.1", port)
    try:
        with pytest.raises(ConfigError, match="Address already in use"):
            hold_port("127.0.0.1", port)  # another parent
        with pytest.raises(ConfigError, match="Address already in use"):
            check_port("127.0.0.1", port, option="serve --port")  # a single router
        first = _child_listener(port)
        second = _child_listener(port)  # the children share it
        with pytest.raises(OSError):
            _child_listener(port, reuse_port=False)  # nothing else, once one listens
        first.close()
        second.close()
    finally:
        hold.close()
    check_port("127.0.0.1", port, option="serve --port")  # released


def _race(port: int, parents: int) -> tuple[list[PortHold], list[ConfigError]]:
    """`parents` threads asking `hold_port(port)` at one instant: what each got."""
    barrier = threading.Barrier(parents)
    held: list[PortHold] = []
    refused: list[ConfigError] = []

    def start() -> None:
        barrier.wait()
        try:
            held.append(hold_port("127.0.0.1", port))
        except ConfigError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=start) for _ in range(parents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return held, refused


def test_parents_starting_at_once_never_both_hold_a_port() -> None:
    """Between the probe and the hold another parent's probe would pass too: the lock keeps
    exactly one of them (without it, two held the port within a few tries)."""
    for _ in range(200):
        held, refused = _race(_free_port(), 4)
        for hold in held:
            hold.close()
        assert len(held) == 1 and len(refused) == 3, (held, refused)


def test_port_0_draws_a_port_held_as_one_given() -> None:
    hold = hold_port("127.0.0.1", 0)
    try:
        assert hold.port
        with pytest.raises(ConfigError):
            hold_port("127.0.0.1", hold.port)
        _child_listener(hold.port).close()
    finally:
        hold.close()


def test_every_address_of_the_host_is_held() -> None:
    """`listen.host = ""` is every interface, IPv4 and IPv6 alike: each is probed and held."""
    port = _free_port()
    hold = hold_port("", port)
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            hold_port("127.0.0.1", port)  # inside 0.0.0.0
        child = socket.socket()
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        child.bind(("0.0.0.0", port))
        child.listen()
        child.close()
    finally:
        hold.close()


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this host")
def test_a_drawn_port_is_held_on_every_address_of_the_host() -> None:
    """Port 0 on `""` (0.0.0.0 and ::) held the IPv4 address alone: [::]:P was anyone's."""
    hold = hold_port("", 0)
    try:
        for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            with socket.socket(family) as other, pytest.raises(OSError):
                if family == socket.AF_INET6:
                    other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind((address, hold.port))
    finally:
        hold.close()


def test_the_refusal_shows_what_an_empty_host_binds_and_the_option_given() -> None:
    """`""` was shown as nothing ("cannot listen on :8000"), and every command's refusal
    named "serve --port, up --router-port"."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            hold_port("", port, option="indexer --port")
    said = str(caught.value)
    shown = f"cannot listen on 0.0.0.0:{port} and [::]:{port} (Address already in use)"
    assert said.startswith(shown), said
    assert "(indexer --port)" in said and "up --router-port" not in said


def test_ports_are_held_all_or_none() -> None:
    """`hold_ports` (the metrics port of each `--processes` child): one taken refuses them all,
    naming its key, and leaves none held."""
    first, second = _free_port(), _free_port()
    with _child_listener(second, reuse_port=False):
        with pytest.raises(ConfigError, match=f"127.0.0.1:{second} for metrics") as caught:
            hold_ports(
                "127.0.0.1",
                [first, second],
                option="listen.metrics_port",
                key="listen.metrics_port",
                serving="metrics",
            )
        assert caught.value.key == "listen.metrics_port"
    hold = hold_ports("127.0.0.1", [first, second], option="x", key="listen.metrics_port")
    try:
        assert hold.port == first
        for port in (first, second):
            _child_listener(port).close()  # a child joins its own
            with pytest.raises(ConfigError):
                hold_port("127.0.0.1", port)
    finally:
        hold.close()
