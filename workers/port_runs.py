"""Where a worker's DP ranks look for a run of free consecutive ports (events or replay, base 0).

A run inside the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by
default) crosses the ports of the host's outgoing connections, which come and go: with ~600
sockets open, a random run of 520 ports there was taken in most of 64 tries ("no run of 520
free consecutive ports"). Outside that range a port is taken only by a server that bound it,
so runs are drawn from the ports above and below it, by their size."""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["ephemeral_range", "run_base"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, for hosts that do not say
_LOWEST = 1024  # below: privileged ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (first, last), Linux's default where it cannot be read."""
    try:
        first, last = (int(word) for word in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    if not _LOWEST <= first <= last <= 65535:
        return _DEFAULT_EPHEMERAL
    return first, last


def run_base(count: int, rng: random.Random, ephemeral: tuple[int, int]) -> int:
    """A base for `count` consecutive ports, the whole run outside `ephemeral` where there is
    room for it (else anywhere from 1024 up: the host gave the ephemeral range all its ports)."""
    first, last = ephemeral
    spans = [(_LOWEST, first - count), (last + 1, 65536 - count)]  # base ranges, inclusive
    spans = [(low, high) for low, high in spans if high >= low]
    if not spans:
        return rng.randint(_LOWEST, 65536 - count)
    sizes = [high - low + 1 for low, high in spans]
    low, high = rng.choices(spans, weights=sizes)[0]
    return rng.randint(low, high)
