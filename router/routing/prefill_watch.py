"""When a prefill side has computed a request's prompt, told by its KV events, not its answer.

A prefill worker of a prefill/decode pair answers only once its decode has fetched the KV
(SGLang's bootstrap room): the prefill itself ended earlier, and what is left is a handoff that
computes nothing. Counting the prompt as queued prefill until that answer counts it twice in
the admission forecast (its pages are held, per the events, and queued) and makes the worker
look busier than it is to the `kv` score, the longer the decodes take to fetch.

The worker's events say when the prefill is over: its prompt's blocks are stored. A request
is watched by the last full block of its prompt short of its last token (the blocks the index
is asked about) on each stream it went to, when that block was not held at dispatch (else its
store proves nothing about this request); once a stream holds it, the request is computed
(`LoadTracker.computed`). An answer or an end first drops the watch. Two requests with one
prompt share that block: the second is then taken as computed too, which it nearly is, its
whole prompt being cached.

Pure bookkeeping: the planner sweeps a stream's watch after each event batch applied there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.routing.load import Ticket

__all__ = ["PrefillWatch"]

# watched requests on one stream beyond which `watch` drops the settled ones itself
_PRUNE_AT = 64


class PrefillWatch:
    """The requests on prefill sides whose prompts are not known to be stored yet."""

    __slots__ = ("_streams",)

    def __init__(self) -> None:
        # stream -> id(ticket) -> (the ticket, the key of its prompt's last full block there)
        self._streams: dict[str, dict[int, tuple[Ticket, int]]] = {}

    def __len__(self) -> int:
        return sum(len(watched) for watched in self._streams.values())

    def watch(self, stream: str, ticket: Ticket, last_key: int) -> None:
        """`ticket`'s prompt goes to `stream`, which does not hold its last full block yet."""
        watched = self._streams.setdefault(stream, {})
        if len(watched) >= _PRUNE_AT:
            # a stream that applies no batch is never swept: what answered or ended there
            # goes now, so the watch stays within the requests in flight on it
            _drop_settled(watched)
        watched[id(ticket)] = (ticket, last_key)

    def sweep(self, stream: str, holds: Callable[[str, Sequence[int]], list[bool]]) -> list[Ticket]:
        """The requests watched on `stream` whose last block it now holds (`holds(stream,
        keys)`), each once; the ones that answered, ended or were found computed on another
        stream meanwhile are dropped unreported."""
        watched = self._streams.get(stream)
        if watched is None:
            return []
        _drop_settled(watched)
        computed: list[Ticket] = []
        if watched:
            entries = list(watched.items())
            stored = holds(stream, [last for _, (_, last) in entries])
            for (key, (ticket, _)), held in zip(entries, stored, strict=True):
                if held:
                    del watched[key]
                    computed.append(ticket)
        if not watched:
            del self._streams[stream]
        return computed


def _drop_settled(watched: dict[int, tuple[Ticket, int]]) -> None:
    """Drop the requests that answered, ended, or were found computed on another stream."""
    for key in [k for k, (t, _) in watched.items() if not t.queued]:  # an end unqueues too
        del watched[key]
