"""What the worker says it reused: `cached_tokens` read from its own answer.

The engines report the prompt tokens they served from cache in every answer that carries usage:
OpenAI routes in `usage.prompt_tokens_details.cached_tokens` (the whole body, or the final SSE
usage chunk when the client asked for `stream_options.include_usage`), SGLang's `/generate` in
`meta_info.cached_tokens` (every streamed event carries it, the last one is final). Held against
the index's prediction (`x-kvroute-matched-tokens`) it makes prediction accuracy a live metric.
A batch (a list of prompts) is routed by its first prompt, but its usage is every item's: the
relay reads none of it (`router.http.answer_relay`), whole or streamed.

The router reads it without decoding the answer: the key is found from the end (`rfind`) and
its integer read in place. A JSON key cannot hide inside a string value (a quote in a string is
escaped, so `"cached_tokens"` followed by `"` never occurs there), so the last key is the
answer's own; one whose value is no count (null, a fraction, a negative, a number too long) is
passed over for the one before it, as a JSON decoder would find (a property test holds the two
together). A stream is scanned only at its end, over its last few chunks (kept by reference,
nothing copied per chunk, 8 KiB at least): the usage event is the last data event before
`[DONE]`.
"""

from __future__ import annotations

import re
from collections import deque

__all__ = ["StreamTail", "cached_tokens"]

_KEY = b'"cached_tokens"'
# a count: an integer of at most 12 digits, not the start of a longer one, a fraction or an
# exponent (read as a number, `0.5` or `1e3` would give a count the engine never said)
_VALUE = re.compile(rb"\s*:\s*(\d{1,12})(?![\d.eE])")
# the usage event and `data: [DONE]` after it fit in this many bytes, however they were read
_TAIL_BYTES = 8192


def cached_tokens(payload: bytes) -> int | None:
    """The last `cached_tokens` integer in a JSON answer (or SSE text); None without one.

    A batched `/generate` answer (a JSON list) has one per item and no one prediction to hold
    them against: None.
    """
    return None if payload[:1] == b"[" else _last_value(payload)


def _last_value(text: bytes) -> int | None:
    at = text.rfind(_KEY)
    while at >= 0:
        found = _VALUE.match(text, at + len(_KEY))
        if found is not None:
            return int(found.group(1))
        # `"cached_tokens": null` (an engine that does not count), or no count at all: look
        # further back
        at = text.rfind(_KEY, 0, at)
    return None


class StreamTail:
    """The last few chunks of a streamed answer, to read its usage when it ends."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        """Keep `chunk` (by reference), letting go of the oldest ones beyond the tail's bytes."""
        chunks = self._chunks
        chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(chunks[0]) >= _TAIL_BYTES:
            self._size -= len(chunks.popleft())

    def cached_tokens(self) -> int | None:
        """The stream's final `cached_tokens`, if its tail carries one."""
        if not self._chunks:
            return None
        # a batch's stream is never fed here (its events are each item's): the last key is
        # the request's
        return _last_value(b"".join(self._chunks))
