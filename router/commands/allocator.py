"""A fixed mmap threshold for glibc's malloc, set once when a long-running verb starts.

glibc starts serving blocks of >= 128 KiB with mmap, but raises that threshold (up to 32 MiB)
each time such a block is freed, so afterwards large, short-lived buffers (request and response
bodies, event payloads, replies) come from the heap instead, between long-lived objects, and the
heap fragments: in `kvroute bench soak` the router and each reference worker grew 1.6-1.8 MB in
5 minutes at about 600 requests/s with every structure bounded and the traced Python heap flat.
With the threshold pinned at 128 KiB (which also turns the dynamic adjustment off) the same run
grew 0.33 MB (router) and 0.01 MB (workers). Outside glibc (musl, macOS) there is nothing to do.

An operator's own `MALLOC_MMAP_THRESHOLD_` wins, and `KVROUTE_MALLOC_TUNING=off` leaves the
allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "pin_mmap_threshold"]

MMAP_THRESHOLD = 128 << 10  # glibc's own starting value
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)

log = logging.getLogger(__name__)


def pin_mmap_threshold(environ: dict[str, str] | None = None) -> bool:
    """Pin glibc's mmap threshold at MMAP_THRESHOLD; whether it was set here."""
    env = os.environ if environ is None else environ
    if env.get("KVROUTE_MALLOC_TUNING", "").lower() == "off" or "MALLOC_MMAP_THRESHOLD_" in env:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; the allocator keeps its defaults")
    return done
