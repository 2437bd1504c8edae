"""The bootstrap fields both legs of an SGLang prefill/decode pair get (`BootstrapFields`).

SGLang (`BOOTSTRAP_ROOM`) pairs a request's two legs by what the router splices into the body
as the client sent it: `bootstrap_host` (the prefill's host), `bootstrap_port` (its bootstrap
port) and the same fresh random `bootstrap_room`, a room per item of a batched `/generate`;
both are also told `disagg_prefill_dp_rank` when the prefill side runs on a named rank (the
router's, or the client's where the router does not know the prefill's ranks): SGLang 0.5.23's
prefill then skips its room check, and its decode looks for the KV on that rank. A prefill
worker with several DP ranks runs a request on rank `room % dp_size` (SGLang 0.5.23's
`follow_bootstrap_room`), and fails its KV handoff when told another rank, so the room is drawn
among those that name the rank the router chose.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.http.pair_failure import PrefillFailed
from router.prompt.dp_rank import with_body_members
from router.prompt.request import Endpoint, ParsedRequest
from router.routing.planner import Planner
from router.routing.policy import Candidate

__all__ = ["BootstrapFields"]

_ROOMS = 2**63  # SGLang's router draws bootstrap rooms in [0, 2**63)


class BootstrapFields:
    """Draws the bootstrap rooms of SGLang pairs and splices them, with the prefill's host and
    bootstrap port, into the body both legs get."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner
        self._rooms = random.SystemRandom()

    def port(self, prefill: Candidate) -> int:
        """The bootstrap port the router knows for `prefill`."""
        entry = self._planner.pool.find(prefill.worker)
        port = entry.bootstrap_port if entry is not None else None
        if port is None:
            raise PrefillFailed("no bootstrap port known for it", hard=False, sent=False)
        return port

    def body(
        self, endpoint: Endpoint, parsed: ParsedRequest, prefill: Candidate, port: int
    ) -> bytes:
        """The request's body as both legs get it (before each is told its own dp rank): the
        bootstrap fields for `prefill` at bootstrap `port`, and the rank it runs on."""
        fields = self._fields(endpoint, parsed, prefill, port)
        # the rank the prefill runs on, told to both legs: the router's, else the client's,
        # forwarded as it wrote it (the router does not know the prefill's ranks). With it the
        # prefill skips its room check and the decode looks there (SGLang 0.5.23,
        # `common/conn.py`, `decode.py`); before, a client's rank with a random room failed
        # the handoff ("follow_bootstrap_room conflict") on all but 1 in dp_size requests
        rank = prefill.dp_rank if prefill.dp_rank is not None else parsed.dp_rank
        told = {} if rank is None else {"disagg_prefill_dp_rank": rank}
        return with_body_members(parsed.body, {**fields, **told})

    def _fields(
        self, endpoint: Endpoint, parsed: ParsedRequest, prefill: Candidate, port: int
    ) -> dict[str, Any]:
        """SGLang's bootstrap fields for one request: a room per item of a batch."""
        host = urlsplit(prefill.url).hostname or "127.0.0.1"
        count = _batch_size(parsed.body) if endpoint is Endpoint.GENERATE else None
        ranks = self._planner.indexer.dp_size(prefill.worker)
        if count is None:
            return {
                "bootstrap_host": host,
                "bootstrap_port": port,
                "bootstrap_room": self._room(prefill.dp_rank, ranks),
            }
        return {
            "bootstrap_host": [host] * count,
            "bootstrap_port": [port] * count,
            "bootstrap_room": [self._room(prefill.dp_rank, ranks) for _ in range(count)],
        }

    def _room(self, rank: int | None, ranks: int) -> int:
        """A random room in [0, 2^63) that names `rank` of a prefill worker with `ranks` ranks.

        SGLang 0.5.23's prefill (`load_balance_method` auto: `follow_bootstrap_room`) runs a
        request on rank `room % dp_size`, and its KV sender fails a request told another rank
        without `disagg_prefill_dp_rank` ("follow_bootstrap_room conflict"). A fully random
        room named the rank the router scored in only 1 of `ranks` requests: the rest failed
        their handoff on SGLang."""
        if rank is None or ranks < 2 or rank >= ranks:
            return self._rooms.randrange(_ROOMS)
        return self._rooms.randrange(_ROOMS // ranks) * ranks + rank


def _batch_size(raw: bytes) -> int | None:
    """Items of a batched `/generate` (None: one prompt), as SGLang's router counts them."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    text = body.get("text")
    if text is not None:
        return len(text) if isinstance(text, list) else None
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None
