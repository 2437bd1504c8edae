"""A request no worker can take: the 503 counts the workers out by why (draining, unhealthy, an
open circuit), on a whole request and on a pair's side, and the `/admin/route` dry run says
the same; reference workers behind a real router.

Before, only open circuits were counted: a model whose one worker was drained or dead was
`no routable worker among 1`, and a pair's dry run with no routable decode named its prefill
worker as the choice, with no reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp

from router.service import RouterService
from tests.router.conftest import STALL_PROOF_HEALTH, Fleet, eventually, router_config
from tests.router.test_router_pd import reference, warm
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

BODY = {
    "input_ids": [(i * 7) % 250 + 3 for i in range(3 * 16 + 1)],
    "sampling_params": {"max_new_tokens": 2},
}
UNHEALTHY = "unhealthy (failed its last health check)"


async def _refused(fleet: Fleet) -> str:
    """The message of the 503 the proxy answers BODY with."""
    status, _, answer = await fleet.post("/generate", BODY)
    assert status == 503 and answer["error"]["type"] == "NoWorkerError", answer
    return str(answer["error"]["message"])


async def _drain(fleet: Fleet, worker: str, drain: bool = True) -> None:
    assert (await fleet.admin("POST", f"/workers/{worker}/drain", {"drain": drain}))[0] == 200


async def test_a_503_counts_the_workers_drained_and_unhealthy() -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with contextlib.AsyncExitStack() as gone, ReferenceWorker(cfg) as w0:
        w1 = await gone.enter_async_context(ReferenceWorker(cfg))
        config = router_config([("w0", w0.url), ("w1", w1.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            await _drain(fleet, "w0")
            await _drain(fleet, "w1")
            message = await _refused(fleet)
            assert message == "no routable worker among 2: 2 draining"
            plan = await fleet.route(BODY)
            assert (plan["worker"], plan["unroutable"]) == (None, message)

            await _drain(fleet, "w1", False)
            await gone.aclose()  # w1's process is gone: its health checks fail

            async def unhealthy() -> bool:
                return router.planner.pool.get("w1").healthy is False

            await eventually(unhealthy, what="w1 to be found unhealthy")
            message = await _refused(fleet)
            assert message == f"no routable worker among 2: 1 draining, 1 {UNHEALTHY}"
            assert (await fleet.route(BODY))["unroutable"] == message

            await _drain(fleet, "w0", False)
            plan = await fleet.route(BODY)
            assert (plan["worker"], plan["unroutable"]) == ("w0", None)


@contextlib.asynccontextmanager
async def _pairs(prefills: int) -> AsyncIterator[Fleet]:
    """`prefills` prefill workers p0, ... and one decode d0 behind a router."""
    async with contextlib.AsyncExitStack() as stack:
        ps = [
            await stack.enter_async_context(ReferenceWorker(reference("prefill")))
            for _ in range(prefills)
        ]
        d0 = await stack.enter_async_context(ReferenceWorker(reference("decode")))
        workers = {f"p{i}": p for i, p in enumerate(ps)} | {"d0": d0}
        config = router_config(
            [(name, w.url) for name, w in workers.items()], health=STALL_PROOF_HEALTH
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, ps, [d0])
            yield Fleet(router, workers, session)


async def test_a_pairs_503_counts_its_side_drained_and_with_an_open_circuit() -> None:
    async with _pairs(2) as fleet:
        await _drain(fleet, "p0")
        fleet.router.planner.record_failure("p1", hard=True)  # what a refused connection does
        message = await _refused(fleet)
        assert message.startswith(
            "no routable prefill worker among 2: 1 draining, 1 with an open circuit after "
            "failures (breaker.cooldown_s), the first tried again in "
        ), message
        plan = await fleet.route(BODY)
        # the same sentence (the seconds left aside: they count down)
        assert plan["unroutable"].rpartition(" in ")[0] == message.rpartition(" in ")[0]
        assert (plan["worker"], plan["decode_worker"]) == (None, None)


async def test_the_dry_run_of_a_pair_with_no_routable_decode_names_no_worker() -> None:
    """The dry run says what the request gets: no pair, and why, as the proxy's 503 says it
    (it answered `"worker": "p0"` with `"decode_worker": null` and no reason)."""
    async with _pairs(1) as fleet:
        await _drain(fleet, "d0")
        message = await _refused(fleet)
        assert message == "no routable decode worker among 1: 1 draining"
        plan = await fleet.route(BODY)
        assert plan["mode"] == "prefill_decode"
        assert (plan["worker"], plan["decode_worker"], plan["dp_rank"]) == (None, None, None)
        assert plan["unroutable"] == message
        # each side still shows its own ranking
        assert (plan["prefill"]["worker"], plan["decode"]["worker"]) == ("p0", None)
        assert [c["status"] for c in plan["decode"]["candidates"]] == ["draining"]

        await _drain(fleet, "p0")  # both sides out: the prefill side is named, as the proxy does
        message = await _refused(fleet)
        assert message == "no routable prefill worker among 1: 1 draining"
        assert (await fleet.route(BODY))["unroutable"] == message

        await _drain(fleet, "p0", False)
        await _drain(fleet, "d0", False)
        plan = await fleet.route(BODY)
        assert (plan["worker"], plan["decode_worker"], plan["unroutable"]) == ("p0", "d0", None)
