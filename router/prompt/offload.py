"""Parsing and tokenizing long prompts on a worker thread, so the event loop keeps serving.

This module only owns the threads (the prompt package is synchronous); `router.http.intake`
awaits their futures.

A Hugging Face `tokenizer.json` encode of a ~5,000-token prompt costs milliseconds of CPU; on
the loop, every other request waits that long. `tokenizers` releases the GIL in `encode_batch`
(not in `encode`), so a long prompt's encode on a thread lets the loop run beside it on another
core. Only bodies of at least `min_bytes` go to the threads: the hop (a future, a wake-up of
the loop) costs more than a short prompt's whole encode (microseconds), and the byte tokenizer
(pure Python) holds the GIL, so it never offloads. What this buys on a 2-core machine is
measured by `kvroute bench tokenize` (docs/benchmarks/tokenize.md), which decided the default:
with 4 clients sending ~5,500-token prompts beside 4 sending tiny ones, the tiny ones' p50 went
from 63 ms (encode on the loop) to 2.9 ms (2 threads), long prompts alone from 87/s to 112/s,
and long prompts beside the tiny ones from 64/s to 59/s (after each encode a thread waits for
the GIL while the loop is busy). docs/router.md "Tokenizing off the loop" has both runs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["TokenizeOffload"]

_T = TypeVar("_T")


class TokenizeOffload:
    """A small thread pool for the parse of long prompts; `close` when the app stops."""

    def __init__(self, min_bytes: int, threads: int) -> None:
        self.min_bytes = min_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvroute-tok")

    def wants(self, body_bytes: int) -> bool:
        """Whether a body this long is parsed on a thread."""
        return body_bytes >= self.min_bytes

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """`fn()` on a pool thread, in the caller's context (trace spans find their parent).

        The caller awaits the future (`asyncio.wrap_future`); one that stops waiting leaves the
        encode already running to finish and be dropped.
        """
        return self._pool.submit(contextvars.copy_context().run, fn)

    def close(self) -> None:
        """Stop the threads (queued work is dropped: its requests are gone with the app)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
