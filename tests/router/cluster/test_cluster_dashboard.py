"""Dashboard sessions across replicas: a logout on one ends the session on every replica."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from router.cluster.fleet_state import LOGOUT_TTL_S
from router.cluster.server import NatsServer
from router.http.dashboard.session import SESSION_S
from router.service import RouterService
from tests.router.cluster.conftest import CuttableLink, cluster, replica_config, workers
from tests.router.conftest import eventually
from tests.router.ops.test_dashboard import (
    logged_in,
    logout,
    shows_login_form,
    state_status,
)


def _sid(cookie: dict[str, str]) -> str:
    return cookie["Cookie"].split(".")[1]


def test_a_logout_record_outlives_its_session() -> None:
    assert LOGOUT_TTL_S == SESSION_S  # the bucket's TTL: a record goes once its session would


async def test_a_logout_on_one_replica_ends_the_session_on_every_replica(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, logging out only told the browser to drop the cookie: its value, replayed,
    opened the dashboard on the replica that logged out, on every other one, and on one
    started later, until its expiry. Now the logout is a record every replica applies."""
    caplog.set_level(logging.DEBUG)
    async with workers(1) as (w0,):
        config = [("w0", w0.url)]
        async with (
            RouterService(replica_config(config, nats_server.url, "a")) as a,
            RouterService(replica_config(config, nats_server.url, "b")) as b,
        ):
            cookie, kept = await logged_in(a), await logged_in(b)
            for router in (a, b):
                for sent in (cookie, kept):
                    assert await state_status(router, sent) == 200  # one token, one login
            await logout(a, cookie)
            assert await state_status(a, cookie) == 401  # at once where it was logged out

            async def refused_on_b() -> bool:
                return await state_status(b, cookie) == 401

            await eventually(refused_on_b, what="b to apply a's logout")
            assert await shows_login_form(b, cookie) and await shows_login_form(a, cookie)
            for router in (a, b):
                assert await state_status(router, kept) == 200  # the other session stands
            # a replica started after the logout reads it back
            async with RouterService(replica_config(config, nats_server.url, "c")) as c:
                assert await state_status(c, cookie) == 401
                assert await shows_login_form(c, cookie)

                async def kept_on_c() -> bool:
                    return await state_status(c, kept) == 200

                await eventually(kept_on_c, what="c to accept the session still open")
    # the session id opens nothing without its MAC, and is still never logged
    assert not [r for r in caplog.records if _sid(cookie) in r.getMessage()]


async def test_a_logout_while_nats_is_away_is_kept_and_shared_when_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica cut from NATS ends the session at once itself, keeps the record like an
    admin change (`kvroute_cluster_unsent_admin_writes`) and writes it when NATS answers;
    the others end the session then."""
    caplog.set_level(logging.DEBUG)
    nats = NatsServer(store_dir=tmp_path)
    await nats.start()
    try:
        async with workers(1) as (w0,), CuttableLink(nats.port) as link:
            config = [("w0", w0.url)]
            async with (
                RouterService(replica_config(config, link.url, "a")) as a,
                RouterService(replica_config(config, nats.url, "b")) as b,
            ):
                assert a.cluster is not None
                cookie = await logged_in(b)
                await link.cut()

                async def a_degraded() -> bool:
                    return a.cluster is not None and a.cluster.status == "degraded"

                await eventually(a_degraded, what="a to notice it lost NATS")
                await logout(a, cookie)
                assert await state_status(a, cookie) == 401
                assert a.cluster.fleet.describe_unsent() == ["a dashboard logout"]
                assert a.cluster.gauges()["unsent_admin_writes"] == 1.0
                said = [r.getMessage() for r in caplog.records if "logout ended" in r.getMessage()]
                assert len(said) == 1 and "this replica only until NATS answers" in said[0]
                # b has not heard of it: the session is open there until NATS answers
                assert await state_status(b, cookie) == 200
                await link.open()

                async def refused_on_b() -> bool:
                    return await state_status(b, cookie) == 401

                await eventually(refused_on_b, what="a's kept logout to reach b", timeout_s=20)
                assert a.cluster.fleet.describe_unsent() == []
    finally:
        await nats.stop()
    assert not [r for r in caplog.records if _sid(cookie) in r.getMessage()]


async def test_a_replica_started_while_nats_is_away_accepts_its_own_sessions_only_until_it_reads(
    tmp_path: Path,
) -> None:
    """A replica that could not read the logouts at its start does not know which sessions
    ended elsewhere: it refuses the cookies of sessions it did not start until it has read
    them (a new login on it works meanwhile). Before, it accepted every signed cookie, the
    ones logged out before it started too."""
    nats = NatsServer(store_dir=tmp_path)
    await nats.start()
    try:
        async with workers(1) as (w0,), CuttableLink(nats.port) as link:
            config = [("w0", w0.url)]
            async with RouterService(replica_config(config, nats.url, "a")) as a:
                ended, open_ = await logged_in(a), await logged_in(a)
                await logout(a, ended)
                await link.cut()  # its port kept: c dials it until it listens again
                late = cluster(link.url, replica_id="c", startup_timeout_s=0.3)
                async with RouterService(replica_config(config, link.url, "c", cluster=late)) as c:
                    assert c.cluster is not None and c.cluster.status == "degraded"
                    for sent in (ended, open_):
                        assert await state_status(c, sent) == 401
                    fresh = await logged_in(c)
                    assert await state_status(c, fresh) == 200
                    await link.open()

                    async def open_on_c() -> bool:
                        return await state_status(c, open_) == 200

                    await eventually(open_on_c, what="c to read the logouts", timeout_s=20)
                    assert await state_status(c, ended) == 401
                    assert await state_status(c, fresh) == 200
    finally:
        await nats.stop()


async def test_the_logouts_a_lost_store_forgot_are_written_back_on_resync(
    tmp_path: Path,
) -> None:
    """A nats-server restarted with an empty store lost the logout records: the replica that
    held the logout still refused the cookie, but one started after took it again. The
    running replicas now write back the logouts they hold when they resync."""
    for store in ("first", "second"):
        (tmp_path / store).mkdir()
    nats = NatsServer(store_dir=tmp_path / "first")
    await nats.start()
    try:
        async with workers(1) as (w0,):
            config = [("w0", w0.url)]
            async with RouterService(replica_config(config, nats.url, "a")) as a:
                cookie = await logged_in(a)
                await logout(a, cookie)
                await nats.stop()
                nats = NatsServer(port=nats.port, store_dir=tmp_path / "second")  # empty
                await nats.start()

                async def resynced() -> bool:
                    assert a.cluster is not None
                    return a.cluster.status.value == "ok"

                await eventually(resynced, what="a to resync with the empty store")
                async with RouterService(replica_config(config, nats.url, "c")) as c:
                    assert await state_status(c, cookie) == 401
    finally:
        await nats.stop()
