"""What the log says of a fleet's prefill/decode roles: a configured role the worker does not
advertise, and a model served by one side of the pairs only. Reference workers (which advertise
their `disaggregation_mode` as SGLang does) behind a real router."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
import pytest

from router.config import WorkerConfig
from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from tests.router.test_router_pd import reference
from workers.worker import ReferenceWorker

_NOTES = "router.fleet.registration_notes"
_SIDES = "router.fleet.pd_sides"


def _said(caplog: pytest.LogCaptureFixture, logger: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


async def _rounds(router: RouterService, n: int) -> None:
    """Let `n` more health rounds run (`health.interval_s` 0.2)."""
    await asyncio.sleep(0.2 * n + 0.1)


async def test_a_configured_role_the_worker_does_not_advertise_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Roles written on the wrong workers are routed as the config says (it overrides), but
    said once per worker at registration. Before, nothing said it: every request was a 502
    "cannot reach the prefill's bootstrap server", which sent the operator to the ports."""
    caplog.set_level(logging.WARNING, logger=_NOTES)
    async with (
        ReferenceWorker(reference("prefill")) as p,
        ReferenceWorker(reference("decode")) as d,
        ReferenceWorker(reference("decode")) as agreed,
    ):
        workers = (
            WorkerConfig(url=p.url, id="p", role="decode"),
            WorkerConfig(url=d.url, id="d", role="prefill"),
            WorkerConfig(url=agreed.url, id="agreed", role="decode"),
        )
        config = msgspec.structs.replace(router_config([]), workers=workers)
        async with RouterService(config) as router:
            await _rounds(router, 3)  # nothing said again on the health rounds
            assert {e.id: e.role for e in router.planner.pool} == {
                "p": "decode",
                "d": "prefill",
                "agreed": "decode",
            }
    assert _said(caplog, _NOTES, logging.WARNING) == [
        "worker p: the config says role 'decode', the worker advertises 'prefill' (its "
        "disaggregation_mode): routed as a decode worker, as the config says, and each pair "
        "through it is likely to fail; fix `role` in its config, or leave it out to take the "
        "worker's",
        "worker d: the config says role 'prefill', the worker advertises 'decode' (its "
        "disaggregation_mode): routed as a prefill worker, as the config says, and each pair "
        "through it is likely to fail; fix `role` in its config, or leave it out to take the "
        "worker's",
    ]


async def test_a_model_served_by_one_side_of_the_pairs_only_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model whose workers are all prefill workers refuses every request (503): said in one
    WARNING line from the startup on, not on every round, and its end once a decode worker
    serves it. Before, only the clients' 503s said it."""
    caplog.set_level(logging.INFO, logger=_SIDES)
    async with (
        ReferenceWorker(reference("prefill")) as p,
        ReferenceWorker(reference("decode")) as d,
        RouterService(router_config([("p", p.url)])) as router,
        aiohttp.ClientSession() as session,
    ):

        async def warned() -> bool:
            return bool(_said(caplog, _SIDES, logging.WARNING))

        await eventually(warned, what="the one-sided model to be said")
        await _rounds(router, 3)
        assert _said(caplog, _SIDES, logging.WARNING) == [
            "model 'kvroute/reference-byte-lm': its 1 prefill worker(s) have no decode "
            "worker to pair with: every request is refused (503, no routable decode "
            "worker) until a decode worker serves it; check the workers' `role` (in the "
            "config, or the `disaggregation_mode` they advertise)"
        ]
        body = {"url": d.url, "id": "d"}
        async with session.post(router.url + "/admin/workers", json=body, headers=AUTH) as r:
            assert r.status == 201, await r.text()

        async def over() -> bool:
            return bool(_said(caplog, _SIDES, logging.INFO))

        await eventually(over, what="the end of the one-sided model to be said")
        assert _said(caplog, _SIDES, logging.INFO) == [
            "model 'kvroute/reference-byte-lm' is no longer served by one side of the pairs only"
        ]
        assert len(_said(caplog, _SIDES, logging.WARNING)) == 1
