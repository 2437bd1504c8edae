"""Room for a worker's zmq sockets: each DP rank's PUB and ROUTER, and their descriptors.

A rank holds two zmq sockets and four file descriptors (each socket's listener and mailbox).
libzmq's table holds 1,023 sockets unless told more before the first one, so a worker of
600 ranks failed to bind as if its ports were taken; told more than the process has
descriptors for, libzmq aborts the process when one runs out ("Too many open files
(src/ip_resolver.cpp:542)"). So the soft descriptor limit is raised towards the hard one when
the ranks need it, and a worker that still would not fit is refused before its first socket."""

from __future__ import annotations

import resource

import zmq
import zmq.asyncio

from workers.errors import WorkerError

__all__ = ["DESCRIPTORS_PER_RANK", "size_for_ranks"]

DESCRIPTORS_PER_RANK = 4  # measured: /proc/PID/fd of a worker of 100 and 200 ranks
_SPARE_SOCKETS = 16  # beyond the ranks' own: libzmq's reaper, a PD transfer's
# beyond the ranks' own: the HTTP listener, its clients, PD's bootstrap, stdio; the soft limit
# is raised to leave the first, and a worker refused when the hard one leaves not even the second
_SPARE_DESCRIPTORS = 256
_LEAST_SPARE_DESCRIPTORS = 64


def size_for_ranks(ctx: zmq.asyncio.Context, ranks: int) -> None:
    """Size `ctx` (before its first socket) and the process's descriptor limit for `ranks`,
    whatever their number (a soft limit of 1,024 runs out at about 250 ranks, well within
    libzmq's default table: 300 ranks aborted); WorkerError when the hard limit leaves too few
    descriptors."""
    sockets = 2 * ranks + _SPARE_SOCKETS
    least = DESCRIPTORS_PER_RANK * ranks + _LEAST_SPARE_DESCRIPTORS
    wanted = DESCRIPTORS_PER_RANK * ranks + _SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft < least:
            raise WorkerError(
                f"--dp-size {ranks} needs at least {least:,} file descriptors (4 a rank), "
                f"and this process may open at most {hard:,} (the hard limit of ulimit -n): "
                "raise it, or run fewer ranks a worker"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if sockets > ctx.get(zmq.MAX_SOCKETS):
        ctx.set(zmq.MAX_SOCKETS, min(sockets, ctx.get(zmq.SOCKET_LIMIT)))
