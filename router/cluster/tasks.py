"""Background tasks that stop when told, within a bound: a replica's and the relay's NATS tasks.

Python 3.11's `asyncio.wait_for`, which nats-py's connect attempts wait in, returns the
attempt's outcome instead of raising CancelledError when the cancellation and the attempt's end
land in one step of the loop: a refused connection raised there is caught by the client's retry
loop (`max_reconnect_attempts=-1`), which tries again, the cancellation lost. Measured against a
port nothing listens on, about one cancellation in two was lost so; a replica or relay stopping
while NATS was down then waited on its connect task forever (a `--processes` child was killed
after its 75 s grace; one whose parent had died served on, orphaned). Now a stop cancels again
those that outlived a cancellation, for a bounded time (`stop_tasks`), the task group of a
replica exits only once its tasks are done (`StoppableTaskGroup`), and the clients are told to
try no more (`router.cluster.nats_client.stop_retrying`), so their connect loops end anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator, Iterable
from typing import Any, TypeVar

__all__ = ["StoppableTaskGroup", "stop_tasks"]

T = TypeVar("T")

# a task's own cleanup (a watcher's unsubscribe) gets this long after the first cancellation;
# one still running then lost it (module docstring) and is cancelled again, this often
_FIRST_WAIT_S = 0.5
_AGAIN_EVERY_S = 0.05


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]], within_s: float
) -> list[asyncio.Task[Any]]:
    """Cancel `tasks` and wait until they are done, cancelling again every `_AGAIN_EVERY_S`
    those still running after `_FIRST_WAIT_S`; returns those still running after `within_s`
    (the caller says so: they are left behind)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    running = {task for task in tasks if not task.done()}
    wait_s = _FIRST_WAIT_S
    while running:
        for task in running:
            task.cancel()
        left_s = deadline - loop.time()
        if left_s <= 0:
            break
        _, running = await asyncio.wait(running, timeout=min(wait_s, left_s))
        wait_s = _AGAIN_EVERY_S
    return sorted(running, key=lambda task: task.get_name())


class StoppableTaskGroup(asyncio.TaskGroup):
    """A TaskGroup whose tasks can be stopped within a bound (`stop`) before it exits: its
    `__aexit__` waits for every task, which a task that lost its cancellation made forever."""

    def __init__(self) -> None:
        super().__init__()
        self.running: set[asyncio.Task[Any]] = set()

    def create_task(
        self,
        coro: Generator[Any, None, T] | Coroutine[Any, Any, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        """`TaskGroup.create_task`, the task kept in `running` until it is done."""
        task = super().create_task(coro, name=name, context=context)
        if not task.done():
            self.running.add(task)
            task.add_done_callback(self.running.discard)
        return task

    async def stop(self, within_s: float) -> list[asyncio.Task[Any]]:
        """Stop every task (`stop_tasks`) and exit the group, raising what `__aexit__` raises
        (a task's error); when some are still running after `within_s`, the group is not
        exited (that would wait for them) and those are returned."""
        left = await stop_tasks(self.running, within_s)
        if not left:
            await self.__aexit__(None, None, None)
        return left
