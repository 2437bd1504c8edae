"""The requests `policy.hold_until_room` holds: one queue per (worker, rank) they wait for.

A held request is planned again only when it may go: when a request on the rank it waits for
answers or ends (the head of that rank's queue looks), when the request ahead of it in the
queue leaves (the room that one found may fit it too), and, at the head of a queue only, every
`poll_s` (a peer replica's requests and a worker's health say nothing here). So a burst of held
requests costs one plan per event, not one per held request per event: with a thousand held,
waking them all on every answer would spend the router's CPU on planning alone.

Queues keep the order requests were first held in, whichever rank each waits for now: a request
held for a rank goes before any held after it (`ahead`), also one that finds room, and a request
moved to another rank's queue takes its place there by age. Over `limits.max_held_requests` the
oldest held request goes first (`release_oldest`: sent as planned, the worker queues it) and the
new one is held in its place, so neither the cap nor the traffic arriving after a request lets a
newer one overtake it (a held request used to see no room for as long as the over-the-cap
requests sent at once kept its worker busy, and reached its deadline). A reload that turns
`hold_until_room` off lets every held request go at once (`release_all`).

Pure bookkeeping over asyncio events; the proxy owns the loop that waits (`Proxy.hold_for_room`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

__all__ = ["HeldRequest", "HeldRequests", "Target"]

Target = tuple[str, int | None]  # (worker, dp rank): a rank is one KV pool


class HeldRequest:
    """One held request: the rank it waits for, its age, and what wakes it."""

    __slots__ = ("order", "released", "target", "woken")

    def __init__(self, target: Target, order: int) -> None:
        self.target = target
        self.order = order  # when it was first held: its place in any queue
        # let go by `release_oldest` or `release_all`: out of the queues and the count, it goes
        # as planned
        self.released = False
        self.woken = asyncio.Event()


class HeldRequests:
    """Queues of held requests by the rank each waits for, oldest first."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._queues: dict[Target, deque[HeldRequest]] = {}
        self._order = itertools.count()
        self.count = 0

    def enter(self, target: Target) -> HeldRequest:
        """A request starts waiting for `target` (the newest held: its queue's end)."""
        held = HeldRequest(target, next(self._order))
        self._queues.setdefault(target, deque()).append(held)
        self.count += 1
        return held

    def ahead(self, target: Target, held: HeldRequest | None = None) -> bool:
        """Whether a request held before `held` (None: a request not held, so any) waits for
        `target`: then `held` waits behind it, room or not."""
        queue = self._queues.get(target)
        if not queue:
            return False
        return held is None or queue[0].order < held.order

    def move(self, held: HeldRequest, target: Target) -> None:
        """`held` waits for another rank now (its first choice changed): in that queue by its
        age, behind the requests held before it."""
        if target == held.target:
            return
        before = held.target
        self._remove(held)
        held.target = target
        queue = self._queues.setdefault(target, deque())
        place = len(queue)
        while place and queue[place - 1].order > held.order:
            place -= 1
        queue.insert(place, held)
        # the request behind it heads the old queue now, and only a head polls: woken here,
        # or it sleeps to its deadline should nothing on that rank ever end again
        self.progressed(before)

    def release_oldest(self) -> bool:
        """Let the oldest held request go as planned (over `limits.max_held_requests`, to make
        a place for a newer one); False when none is held."""
        heads = [queue[0] for queue in self._queues.values()]
        if not heads:
            return False
        oldest = min(heads, key=lambda held: held.order)
        self._remove(oldest)
        self.count -= 1
        oldest.released = True
        oldest.woken.set()
        self.progressed(oldest.target)
        return True

    def release_all(self) -> None:
        """Let every held request go as planned (a reload turned `policy.hold_until_room` off:
        the operator asked for no more holding, so none waits on for room)."""
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            for held in queue:
                held.released = True
                held.woken.set()
        self.count = 0

    def leave(self, held: HeldRequest) -> None:
        """`held` goes (room found, or its deadline): the next in its queue looks next."""
        if held.released:  # out of the queues and the count already
            return
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
