"""The requests `policy.hold_until_room` holds: one queue per (worker, rank) they wait for.

A held request is planned again only when it may go: when a request on the rank it waits for
answers or ends (the head of that rank's queue looks), when the request ahead of it in the
queue leaves (the room that one found may fit it too), and, at the head of a queue only, every
`poll_s` (a peer replica's requests and a worker's health say nothing here). So a burst of held
requests costs one plan per event, not one per held request per event: with a thousand held,
waking them all on every answer would spend the router's CPU on planning alone.

Pure bookkeeping over asyncio events; the proxy owns the loop that waits (`Proxy.hold_for_room`).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["HeldRequest", "HeldRequests", "Target"]

Target = tuple[str, int | None]  # (worker, dp rank): a rank is one KV pool


class HeldRequest:
    """One held request: the rank it waits for, and what wakes it."""

    __slots__ = ("target", "woken")

    def __init__(self, target: Target) -> None:
        self.target = target
        self.woken = asyncio.Event()


class HeldRequests:
    """Queues of held requests by the rank each waits for, oldest first."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._queues: dict[Target, deque[HeldRequest]] = {}
        self.count = 0

    def enter(self, target: Target) -> HeldRequest:
        """A request starts waiting for `target`."""
        held = HeldRequest(target)
        self._queues.setdefault(target, deque()).append(held)
        self.count += 1
        return held

    def move(self, held: HeldRequest, target: Target) -> None:
        """`held` waits for another rank now (its first choice changed): to that queue's end."""
        if target == held.target:
            return
        before = held.target
        self._remove(held)
        held.target = target
        self._queues.setdefault(target, deque()).append(held)
        # the request behind it heads the old queue now, and only a head polls: woken here,
        # or it sleeps to its deadline should nothing on that rank ever end again
        self.progressed(before)

    def leave(self, held: HeldRequest) -> None:
        """`held` goes (room found, or its deadline): the next in its queue looks next."""
        self._remove(held)
        self.count -= 1
        self.progressed(held.target)

    def progressed(self, target: Target) -> None:
        """A request on `target` answered or ended: the head of its queue looks again."""
        queue = self._queues.get(target)
        if queue:
            queue[0].woken.set()

    def wait_s(self, held: HeldRequest, remaining_s: float) -> float:
        """How long `held` waits before it looks again unwoken: the head of a queue polls,
        the others wait their turn (up to `remaining_s`, their deadline)."""
        queue = self._queues.get(held.target)
        if queue and queue[0] is held:
            return min(remaining_s, self.poll_s)
        return remaining_s

    def _remove(self, held: HeldRequest) -> None:
        queue = self._queues.get(held.target)
        if queue is None:
            return
        try:
            queue.remove(held)  # the head, almost always: O(1) there
        except ValueError:
            return
        if not queue:
            del self._queues[held.target]
