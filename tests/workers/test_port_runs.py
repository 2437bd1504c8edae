"""Runs of ports for DP ranks are drawn outside the kernel's ephemeral range, where the host's
outgoing connections take ports (`workers.port_runs`)."""

from __future__ import annotations

import random

from workers.port_runs import ephemeral_range, run_base


def test_a_run_stays_outside_the_ephemeral_range_and_below_65536() -> None:
    rng = random.Random(7)
    bases = [run_base(520, rng, (32768, 60999)) for _ in range(2000)]
    for base in bases:
        run = range(base, base + 520)
        assert run[0] >= 1024 and run[-1] <= 65535, base
        assert run[-1] < 32768 or run[0] > 60999, base  # not one port of it ephemeral
    # both sides are drawn, by their size (1024-32767 holds about seven times 61000-65535)
    above = sum(base > 60999 for base in bases)
    assert 100 < above < 500, above


def test_a_host_whose_ephemeral_range_takes_every_port_draws_anywhere() -> None:
    rng = random.Random(7)
    bases = {run_base(8, rng, (1024, 65535)) for _ in range(200)}
    assert all(1024 <= base <= 65528 for base in bases) and len(bases) > 150


def test_the_ephemeral_range_is_the_kernels() -> None:
    first, last = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as said:
        assert (first, last) == tuple(int(word) for word in said.read().split())
