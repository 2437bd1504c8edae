"""`kvroute up --replicas N`, `kvroute serve --processes N`: N processes, one port, one router."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.cluster.server import NatsServer
from router.commands.replicas import _Child
from tests.router.commands.test_router_serve_cli import _true, refused
from tests.router.commands.test_router_up_cli import _read_until
from tests.router.conftest import eventually
from tests.subprocesses import ends_on_sigint
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


async def _kvroute(*args: str, session: bool = False) -> asyncio.subprocess.Process:
    """`kvroute ARGS`; `session`: in a session (and process group) of its own, as a terminal
    starts a command, for a Ctrl-C to the whole group (`os.killpg`)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=session,
    )  # fmt: skip


async def test_up_with_two_replicas_starts_nats_and_both_serve_one_fleet() -> None:
    proc = await _kvroute(
        "up", "--workers", "1", "--replicas", "2", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        said = await asyncio.wait_for(_read_until(proc.stdout, "nats-server", lines), 60)
        assert "nats://127.0.0.1:" in said and "from " in said  # where it came from
        line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
        url = line.split("listening on ")[1].split()[0]
        # what one router prints under its URL, said of the replicas' one (before: nothing)
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C stops", lines), 10)
        told = "".join(lines)
        assert f"curl -s {url}/v1/chat/completions" in told, told
        assert f"{url}/dashboard" in told and f"{url}/admin/workers" in told, told
        replicas: set[str] = set()
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
        async with aiohttp.ClientSession() as session:
            for _ in range(40):  # a new connection each time: the kernel spreads them
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                    s.get(url + "/health") as resp,
                ):
                    health = await resp.json()
                    assert resp.status == 200 and health["cluster"]["status"] == "ok", health
                    # each has heard the other (their first heartbeats may cross)
                    if health["cluster"]["replicas"] == 2:
                        replicas.add(health["cluster"]["replica"])
                if len(replicas) == 2:
                    break
                await asyncio.sleep(0.05)
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
            # `up` has no config file to read again, with replicas as without: the file they
            # were started from is one `up` wrote; reloading it changed nothing, and the 200
            # and the silently passed-on SIGHUP said otherwise
            async with session.post(url + "/admin/reload") as resp:
                refusal = await resp.json()
                assert resp.status == 400, refusal
            assert "no config file to read again" in refusal["error"]["message"], refusal
            proc.send_signal(signal.SIGHUP)
            await asyncio.wait_for(_read_until(proc.stdout, "SIGHUP ignored", lines), 10)
            assert await _replicas_answering(url) <= replicas
        assert len(replicas) == 2, "every connection went to the same replica"


async def test_up_says_when_the_replicas_nats_server_dies() -> None:
    """Killed, the replicas' nats-server left them each alone, and `up` said nothing."""
    proc = await _kvroute(
        "up", "--workers", "1", "--replicas", "2", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        said = await asyncio.wait_for(
            _read_until(proc.stdout, "nats-server (JetStream)", lines), 60
        )
        url = said.split(" for the replicas: ")[1].split()[0]
        await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
        (nats,) = [pid for pid in _children(proc.pid) if _named(pid, "nats-server")]
        os.kill(nats, signal.SIGKILL)
        line = await asyncio.wait_for(_read_until(proc.stdout, "nats-server (", lines), 10)
        assert f"the replicas' nats-server ({url}) ended (killed by SIGKILL)" in line, line
        assert "each replica serves on alone" in line, line


async def test_up_with_a_relay_serves_hits_through_it() -> None:
    """`kvroute up --replicas 2 --relay`: the replicas hold what the relay writes, and a
    prompt sent twice is predicted the second time."""
    proc = await _kvroute(
        "up", "--workers", "1", "--replicas", "2", "--relay", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        said = await asyncio.wait_for(_read_until(proc.stdout, "kvroute relay", lines), 60)
        relay_url = said.split(" on ")[1].split()[0]
        line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
        url = line.split("listening on ")[1].split()[0]
        body = {
            "text": "a prompt the relay carries to both replicas " * 4,
            "sampling_params": {"max_new_tokens": 1},
        }
        async with aiohttp.ClientSession() as session:
            matched = 0
            for _ in range(100):  # until the relay's records reach the replica that answers
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    answer = await resp.json()
                    matched = int(resp.headers["x-kvroute-matched-tokens"])
                if matched:
                    assert matched <= answer["meta_info"]["cached_tokens"]
                    break
                await asyncio.sleep(0.05)
            assert matched > 0
            async with session.get(relay_url + "/health") as resp:
                assert (await resp.json())["relay"]["published"] > 0


async def test_serve_processes_without_a_cluster_exits_2_saying_why(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[listen]\nport = 0\n[admin]\ntoken = "t"\n')
    proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"[cluster]" in out


async def test_indexer_processes_serve_the_query_api_as_one_and_no_proxy(tmp_path: Path) -> None:
    config = tmp_path / "indexer.toml"
    async with NatsServer() as nats:
        config.write_text(f"[listen]\nport = 0\n[cluster]\nurl = '{nats.url}'\n")
        proc = await _kvroute("indexer", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            assert "2 indexer replica processes" in line
            url = line.split("listening on ")[1].split()[0]
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            query = {"token_ids": [1, 2], "cache_salt": "tenant-a"}
            replicas: set[str] = set()
            namespaces: set[str] = set()
            for _ in range(20):  # new connections: the kernel spreads them over both
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                ):
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 404  # no generation endpoint in either child
                    async with s.post(url + "/v1/kv/query", json=query) as resp:
                        assert resp.status == 200, await resp.text()
                        namespaces.add((await resp.json())["namespace"])
                    async with s.get(url + "/health") as resp:
                        replicas.add((await resp.json())["cluster"]["replica"])
            assert len(replicas) == 2, "every connection went to the same child"
            # one fingerprint key for both: an id one lists is the id the other evicts by
            assert len(namespaces) == 1, namespaces


async def test_a_replica_id_cannot_name_several_processes(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text(
        "[listen]\nport = 0\n[cluster]\nurl = 'nats://127.0.0.1:4222'\nreplica_id = 'edge-1'\n"
    )
    proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"cluster.replica_id 'edge-1' names one process" in out


async def test_a_second_replica_set_on_a_taken_port_is_refused(tmp_path: Path) -> None:
    """A second `serve --processes 2` (or `indexer --processes 2`) on the first's port started
    and said it listened: its children joined the first's SO_REUSEPORT group and the kernel
    split connections between two routers (admin answers alternating between two fleets). It
    is refused now as a single router is, exit 2, and the first's children, restarted after a
    crash, still take the port (held by their parent). The refusal is its one line."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    async with NatsServer() as nats:
        for path in (first, second):
            path.write_text(
                f"[cluster]\nurl = '{nats.url}'\nsubject_prefix = '{path.stem}'\n"
                f"[[workers]]\nid = '{path.stem}-w'\nurl = 'http://127.0.0.1:9'\n"
            )
        proc = await _kvroute("serve", "--config", str(first), "--port", port, "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = f"http://127.0.0.1:{port}"
            for verb in ("serve", "indexer"):
                again = await _kvroute(
                    verb, "--config", str(second), "--port", port, "--processes", "2"
                )
                try:
                    out, _ = await asyncio.wait_for(again.communicate(), 30)
                finally:
                    if again.returncode is None:  # it serves beside the first: stopped
                        again.send_signal(signal.SIGINT)
                        await again.wait()
                assert again.returncode == 2, out
                # its one line (before, "event loop: uvloop" came first)
                (line,) = out.decode().splitlines()
                assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in line, out
            before: set[str] = set()
            while len(before) < 2:
                before |= await _replicas_answering(router)
            after = await _crash_one(router, sorted(before)[0])  # restarted on the given port
            assert len(after) == 2


async def test_replicas_start_on_the_port_a_single_router_just_left(tmp_path: Path) -> None:
    """`kvroute serve` served a client and stopped (its connections wait in TIME_WAIT on the
    port); `serve --processes 2` on that port starts at once and both children answer.
    Before, its hold (SO_REUSEPORT alone) was refused beside that TIME_WAIT: exit 2,
    "Address already in use", for about a minute (QA)."""
    async with NatsServer() as nats:
        config = tmp_path / "router.toml"
        config.write_text(f"[cluster]\nurl = '{nats.url}'\n")
        port, single = await _serve_on_a_free_port(config)
        router = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:  # kept alive: the router closes it
                for _ in range(3):
                    async with session.get(router + "/health") as resp:
                        assert resp.status in (200, 503)
                single.send_signal(signal.SIGINT)
                await asyncio.wait_for(single.communicate(), 30)
        finally:
            if single.returncode is None:
                single.kill()
                await single.wait()
        assert single.returncode == 0
        proc = await _kvroute("serve", "--config", str(config), "--port", port, "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            answering: set[str] = set()
            while len(answering) < 2:
                answering |= await _replicas_answering(router)


async def _serve_on_a_free_port(config: Path) -> tuple[str, asyncio.subprocess.Process]:
    """`kvroute serve` on a port found free, listening; another port when something took that
    one between the probe and the router's bind (CI: another test's socket did, once)."""
    for _ in range(5):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        single = await _kvroute("serve", "--config", str(config), "--port", port)
        assert single.stdout is not None
        lines: list[str] = []
        try:
            await asyncio.wait_for(_read_until(single.stdout, "listening on", lines), 60)
            return port, single
        except AssertionError:
            await single.wait()
            if "(Address already in use)" not in "".join(lines):
                raise
        except BaseException:
            single.kill()
            await single.wait()
            raise
    raise AssertionError("no free port kept long enough for kvroute serve to bind it")


async def _replicas_answering(url: str, tries: int = 20) -> set[str]:
    """The replica ids answering `/health` on `url` over `tries` new connections (the kernel
    spreads them over the listening children); each must answer (503: a router without
    workers is not ready to route, but it is there)."""
    replicas: set[str] = set()
    for _ in range(tries):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.get(url + "/health") as resp,
        ):
            assert resp.status in (200, 503)
            replicas.add((await resp.json())["cluster"]["replica"])
    return replicas


async def test_a_failed_restart_is_retried_while_the_other_child_serves(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    async with NatsServer() as nats:
        # credentials in the URL (a server without auth takes them): never printed
        url = nats.url.replace("nats://", "nats://kvuser:s3cret-pass@")
        good = f"[listen]\nport = 0\n[admin]\ntoken = 't'\n[cluster]\nurl = '{url}'\n"
        config.write_text(good)
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            assert f"through NATS at nats://***@127.0.0.1:{nats.port}" in line, line
            router = line.split("listening on ")[1].split()[0]
            before: set[str] = set()
            while len(before) < 2:  # each child listening, known by its id (host-pid-random)
                before |= await _replicas_answering(router)
            killed, kept = sorted(before)
            # an operator mid-edit: the file no longer parses when a child dies
            config.write_text(good + "bogus_key = 1\n")
            os.kill(int(killed.split("-")[-2]), signal.SIGKILL)
            await asyncio.wait_for(_read_until(proc.stdout, "did not restart", lines), 30)
            assert proc.returncode is None  # the parent is still there
            assert await _replicas_answering(router) == {kept}  # and the other child serves
            config.write_text(good)  # the edit done: the next restart works
            after: set[str] = set()
            async with asyncio.timeout(60):
                while len(after) < 2:
                    after = await _replicas_answering(router)
            assert kept in after and killed not in after  # the restarted child is a new replica
        out = "".join(lines) + (await proc.stdout.read()).decode(errors="replace")
        assert "s3cret-pass" not in out and "kvuser" not in out


async def _admin_statuses(url: str, token: str, tries: int = 16) -> set[int]:
    """The statuses of `GET /admin/workers` with `token`, each on a new connection (the
    kernel spreads them over the children)."""
    statuses: set[int] = set()
    for _ in range(tries):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.get(url + "/admin/workers", headers={"Authorization": f"Bearer {token}"}) as resp,
        ):
            statuses.add(resp.status)
    return statuses


async def _salt_statuses(url: str, salt_bytes: int, tries: int = 16) -> set[int]:
    """The statuses of a completion with a `salt_bytes` cache_salt, each on a new connection
    (the kernel spreads them over the children)."""
    statuses: set[int] = set()
    body = {"model": "kvroute/reference-byte-lm", "prompt": "hi", "max_tokens": 1}
    for _ in range(tries):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.post(url + "/v1/completions", json=body | {"cache_salt": "s" * salt_bytes}) as resp,
        ):
            statuses.add(resp.status)
    return statuses


async def _crash_one(router: str, replica: str) -> set[str]:
    """SIGKILL the child that answers as `replica` and wait until two answer again (without
    it: the restarted one answers as another process); the replicas answering then."""
    os.kill(int(replica.split("-")[-2]), signal.SIGKILL)
    after: set[str] = set()
    async with asyncio.timeout(30):  # before: "did not restart", every 2, 4, 8 s...
        while len(after) < 2 or replica in after:
            try:
                after = await _replicas_answering(router)
            except aiohttp.ClientConnectionError:
                # a connection the kernel had hashed to the killed child as it died is reset
                # (its half-open ones are not moved to a sibling: tcp_migrate_req is off)
                await asyncio.sleep(0.05)
    return after


async def test_a_restarted_child_runs_the_restart_only_keys_its_siblings_run(
    tmp_path: Path,
) -> None:
    """A child restarted after a crash started from the file as edited since: a new
    `admin.token` was taken by it alone (the admin API answered 200 or 401 by connection), as
    were new indexer settings, and a tokenizer file a start refuses kept it from ever coming
    back. It takes the restart-only keys from what its siblings run (the parent's
    config, on its stdin), says the file's in a WARNING line, and the live keys from the
    file, which the others then read too (a salt limit edited and not reloaded was the
    restarted child's alone: 400 or 200 by connection). The parent's config reaches the
    children whole, an infinite timeout included (JSON wrote it null: no child started).
    And a reload under --processes reads the file's host, port and policy (the children were
    given them all on their command line, so a reload of a host off loopback with no admin
    token answered 200, and a start refused the file)."""
    config = tmp_path / "router.toml"
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with NatsServer() as nats, ReferenceWorker(cfg) as worker:
        text = _one_worker_cluster(nats.url, worker.url).replace("'t'", "'a1'")
        text += "[timeouts]\nrequest_s = inf\n"
        config.write_text(text)
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = line.split("listening on ")[1].split()[0]
            before: set[str] = set()
            async with asyncio.timeout(30):
                while len(before) < 2:
                    before = await _replicas_answering(router)
            edited = (
                text.replace("'a1'", "'a2'")
                + "[indexer]\npending_ttl_s = 7.0\n"
                + "[limits]\nmax_salt_bytes = 50\n"
            )
            unloadable = "[tokenizer]\nkind = 'hf'\npath = '/nonexistent/tokenizer.json'\n"
            # a file a reload refuses, and no reload: a crash comes first
            config.write_text(edited + unloadable)
            first = await _crash_one(router, sorted(before)[0])
            # every process takes the token they all started with, and only it
            assert await _admin_statuses(router, "a1") == {200}
            assert await _admin_statuses(router, "a2") == {401}
            said = await asyncio.wait_for(_read_until(proc.stdout, "refused as a reload", lines), 5)
            assert "tokenizer.path" in said, said
            # nothing of the file: its live salt limit neither, as the others refuse it whole
            assert await _salt_statuses(router, 60) == {200}
            # a file a reload takes, and no reload: the restart-only keys are the others', the
            # live ones the file's, which the others are told to read too
            config.write_text(edited)
            (other,) = first & before  # the one not restarted yet
            await _crash_one(router, other)
            said = await asyncio.wait_for(_read_until(proc.stdout, "differ from what", lines), 5)
            for key in ("admin.token", "indexer.pending_ttl_s"):
                assert key in said, said
            assert "max_salt_bytes" not in said, said  # live: the file's, as a reload's
            await asyncio.wait_for(_read_until(proc.stdout, "other replicas told", lines), 5)
            async with asyncio.timeout(10):  # (the told process reloads as it gets to it)
                # the file's 50, everywhere; no event says a reload is done: a poll
                while await _salt_statuses(router, 60) != {400}:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
            assert await _admin_statuses(router, "a1") == {200}
            # every process runs the same restart-only keys: a reload says the same of each
            for _ in range(8):
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                    s.post(
                        router + "/admin/reload", headers={"Authorization": "Bearer a1"}
                    ) as resp,
                ):
                    answer = await resp.json()
                    assert resp.status == 200, answer
                    assert answer["needs_restart"] == ["admin.token", "indexer.pending_ttl_s"], (
                        answer
                    )
            # the file's host, as a start reads it: off loopback with no admin token, refused
            config.write_text(edited.replace("[listen]\n", "[listen]\nhost = '0.0.0.0'\n"))
            config.write_text(config.read_text().replace("token = 'a2'", "token = ''"))
            async with (
                aiohttp.ClientSession() as s,
                s.post(router + "/admin/reload", headers={"Authorization": "Bearer a1"}) as resp,
            ):
                answer = await resp.json()
                assert resp.status == 400 and answer["error"]["key"] == "admin.token", answer


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (two processes' metrics ports)."""
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            if port >= 65535:
                continue
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


async def _requests_total(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """kvroute_requests_total summed per `process` label; every sample must carry one."""
    async with session.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert "process" in sample.labels, sample
            if sample.name == "kvroute_requests_total":
                process = sample.labels["process"]
                totals[process] = totals.get(process, 0.0) + sample.value
    return totals


async def test_each_process_has_its_own_metrics_series_and_port(tmp_path: Path) -> None:
    """Behind one SO_REUSEPORT port each scrape lands on some process: unlabelled, one
    series jumped between the processes' own totals (12, 8, 12...), each drop a counter
    reset to Prometheus. Each process's series are labelled, and served on a port of its own."""
    base = _free_port_pair()
    config = tmp_path / "router.toml"
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with NatsServer() as nats, ReferenceWorker(cfg) as worker:
        config.write_text(
            f"[listen]\nport = 0\nmetrics_port = {base}\n[cluster]\nurl = '{nats.url}'\n"
            f"[[workers]]\nid = 'w'\nurl = '{worker.url}'\n"
        )
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc), aiohttp.ClientSession() as session:
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = line.split("listening on ")[1].split()[0]
            said = await asyncio.wait_for(_read_until(proc.stdout, "metrics of each", lines), 5)
            assert f":{base}/metrics" in said and f":{base + 1}/metrics" in said, said
            body = {"model": "m", "prompt": "count me", "max_tokens": 1}
            for _ in range(20):  # new connections: the kernel spreads them over both
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                    s.post(router + "/v1/completions", json=body) as resp,
                ):
                    assert resp.status == 200, await resp.text()
            ports = [f"http://127.0.0.1:{port}/metrics" for port in (base, base + 1)]
            first = [await _requests_total(session, url) for url in ports]
            # each port is one process, under its own label, the same on every scrape
            assert set(first[0]) <= {"0"} and set(first[1]) <= {"1"}, first
            assert sum(v for t in first for v in t.values()) == 20, first
            for _ in range(3):
                assert [await _requests_total(session, url) for url in ports] == first
            # the shared port answers from one process or the other, labelled as such
            for _ in range(6):
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                ):
                    shared = await _requests_total(s, router + "/metrics")
                    assert len(shared) <= 1 and all(shared[p] == first[int(p)][p] for p in shared)


async def _salt_answers(url: str, salt_bytes: int, tries: int = 20) -> set[int]:
    """The statuses of `tries` completions with a `salt_bytes` salt, each on a new connection
    (the kernel spreads them over the children: 20 all on one of two is 1 in 500,000)."""
    body = {"model": "m", "prompt": "salted", "max_tokens": 1, "cache_salt": "s" * salt_bytes}
    statuses: set[int] = set()
    for _ in range(tries):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.post(url + "/v1/completions", json=body) as resp,
        ):
            statuses.add(resp.status)
    return statuses


def _one_worker_cluster(nats_url: str, worker_url: str) -> str:
    """A router config: worker `w` at `worker_url`, admin token `t`, the cluster at
    `nats_url`, any port."""
    return (
        f"[listen]\nport = 0\n[admin]\ntoken = 't'\n[cluster]\nurl = '{nats_url}'\n"
        f"[[workers]]\nid = 'w'\nurl = '{worker_url}'\n"
    )


async def test_an_http_reload_reaches_every_process(tmp_path: Path) -> None:
    """POST /admin/reload lands on one child: it reloaded alone, answered 200 with the change,
    and the other process kept the old limits (only worker changes travel through the
    cluster), silently. The child now has the parent SIGHUP the others, and says so."""
    config = tmp_path / "router.toml"
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with NatsServer() as nats, ReferenceWorker(cfg) as worker:
        text = _one_worker_cluster(nats.url, worker.url)
        config.write_text(text)
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc), aiohttp.ClientSession() as session:
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = line.split("listening on ")[1].split()[0]
            async with asyncio.timeout(30):
                while len(await _replicas_answering(router)) < 2:
                    pass
            assert await _salt_answers(router, 100) == {200}
            config.write_text(text + "[limits]\nmax_salt_bytes = 50\n")
            admin = {"Authorization": "Bearer t"}
            async with session.post(router + "/admin/reload", headers=admin) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert answer["changed"] == ["limits.max_salt_bytes"], answer
            assert answer["processes"] == {"count": 2, "told": 1}, answer
            # the other one applies it as its SIGHUP arrives, moments after the answer
            async with asyncio.timeout(10):
                while await _salt_answers(router, 100) != {400}:
                    pass
            # the same file again, on whichever child: nothing changes anywhere
            async with session.post(router + "/admin/reload", headers=admin) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert answer["changed"] == [] and answer["processes"]["told"] == 1, answer
            await asyncio.wait_for(_read_until(proc.stdout, "1 other replicas told", lines), 10)
            assert await _salt_answers(router, 100) == {400}


def _named(pid: int, name: str) -> bool:
    """Whether process `pid` runs the program `name`."""
    return Path(f"/proc/{pid}/comm").read_text().strip() == name


def _children(pid: int) -> list[int]:
    """The processes `pid` started and that still run (or are not reaped yet)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_a_reload_reaches_a_starting_or_restarting_child_once_it_listens(
    tmp_path: Path,
) -> None:
    """The parent SIGHUPed every child not exited, listening or not: one still starting had no
    handler yet and died of it. At first start that was the whole router (exit 2, "replica 0
    exited before listening"); a child restarting after a crash died again (told 2 of 3, one of
    them dead). A child starting may have read the file before the change, so it is told
    once it listens, and the answer says so."""
    config = tmp_path / "router.toml"
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with NatsServer() as nats, ReferenceWorker(cfg) as worker:
        text = _one_worker_cluster(nats.url, worker.url)
        config.write_text(text)
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc), aiohttp.ClientSession() as session:
            await eventually(_true(lambda: len(_children(proc.pid)) == 2), 30, "2 children")
            # both just spawned, neither listening yet: an edit, and its reload
            config.write_text(text + "[limits]\nmax_salt_bytes = 50\n")
            proc.send_signal(signal.SIGHUP)
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = line.split("listening on ")[1].split()[0]
            assert "".join(lines).count("told to read the config again") == 2, lines
            async with asyncio.timeout(10):  # both read it again once up
                while await _salt_answers(router, 100) != {400}:
                    pass

            before = _children(proc.pid)
            os.kill(before[0], signal.SIGKILL)
            # its restart spawned, not listening yet
            await eventually(_true(lambda: bool(set(_children(proc.pid)) - set(before))), 30)
            spawned = set(_children(proc.pid)) - set(before)
            config.write_text(text + "[limits]\nmax_salt_bytes = 60\n")
            admin = {"Authorization": "Bearer t"}  # on the one child listening
            async with session.post(router + "/admin/reload", headers=admin) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert answer["processes"] == {"count": 2, "told": 0, "starting": 1}, answer
            await asyncio.wait_for(_read_until(proc.stdout, "1 starting (told once", lines), 10)
            await asyncio.wait_for(_read_until(proc.stdout, "told to read the config", lines), 30)
            async with asyncio.timeout(30):  # the restarted child lived through it
                while len(await _replicas_answering(router)) < 2:
                    pass
            assert spawned <= set(_children(proc.pid))
            assert await _salt_answers(router, 55) == {200}


async def test_each_child_log_line_names_its_process(tmp_path: Path) -> None:
    """The children share the parent's stderr: a bad file reloaded by SIGHUP gave two alike
    `config reload refused` lines (`[-]` in place of anything saying who). Each names its
    process now, as its metrics label does."""
    config = tmp_path / "router.toml"
    good = "[listen]\nport = 0\n[admin]\ntoken = 't'\n[cluster]\nurl = '{}'\n"
    async with NatsServer() as nats:
        config.write_text(good.format(nats.url))
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        async with ends_on_sigint(proc):
            await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            config.write_text(good.format(nats.url) + "bogus_key = 1\n")
            proc.send_signal(signal.SIGHUP)
            refusals = [
                await asyncio.wait_for(_read_until(proc.stdout, "reload refused", lines), 30)
                for _ in range(2)
            ]
            assert {r.split(" ")[3] for r in refusals} == {"process=0", "process=1"}, refusals
            config.write_text(good.format(nats.url))  # so the children stop as they started


async def test_sigterm_lets_a_child_finish_a_long_request(tmp_path: Path) -> None:
    """The parent gave each child 10 s after SIGTERM, then killed it: a 12-s generation was
    cut without a word, which a single router (60 s of grace) lets finish. A SIGHUP in that
    grace, to the parent or a child, ended it at once (the handler went as the grace began):
    the parent silently, its watchdog with it; a child cut its requests. It is said and
    ignored."""
    config = tmp_path / "router.toml"
    cfg = ReferenceConfig(time_scale=1.0, decode_ms_per_token=10.0, page_size=16)
    async with NatsServer() as nats, ReferenceWorker(cfg) as worker:
        config.write_text(
            f"[listen]\nport = 0\n[cluster]\nurl = '{nats.url}'\n"
            f"[[workers]]\nid = 'w'\nurl = '{worker.url}'\n"
        )
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        assert proc.stdout is not None
        lines: list[str] = []
        try:
            line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
            router = line.split("listening on ")[1].split()[0]
            body = {"model": "m", "prompt": "a long one", "max_tokens": 1200, "stream": True}
            events: list[bytes] = []
            started = asyncio.get_running_loop().time()
            async with (
                aiohttp.ClientSession() as session,
                session.post(router + "/v1/completions", json=body) as resp,
            ):
                assert resp.status == 200
                with contextlib.suppress(aiohttp.ClientPayloadError):  # cut: said below
                    async for event in resp.content:
                        if not event.strip():
                            continue
                        events.append(event)
                        if len(events) == 1:  # the request is in flight
                            children = _children(proc.pid)
                            proc.send_signal(signal.SIGTERM)
                            await asyncio.wait_for(
                                _read_until(proc.stdout, "stopping the 2 replicas", lines), 10
                            )
                            port = int(router.rsplit(":", 1)[1])
                            # each child is in its grace
                            await eventually(functools.partial(refused, port), 10, "closed")
                            for pid in (proc.pid, *children):
                                # the child without a request in flight may be gone
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(pid, signal.SIGHUP)
            took = asyncio.get_running_loop().time() - started
            assert events[-1].strip() == b"data: [DONE]", f"cut after {len(events)} events"
            assert took > 10.0, took  # as long as a kill used to come after
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        out = "".join(lines) + (await proc.stdout.read()).decode(errors="replace")
        assert "killed" not in out, out
        assert "SIGHUP ignored: the replicas are stopping" in out, out
        assert "SIGHUP ignored: shutting down" in out, out  # the child serving the stream


async def test_a_child_that_outlives_its_grace_is_killed_saying_so(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A child still running when its grace ends is killed, and the parent says which: a cut
    request is never silent."""
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('listening on http://127.0.0.1:1', flush=True); time.sleep(60)"
    )
    child = _Child(3, [sys.executable, "-c", stubborn], dict(os.environ), stop_timeout_s=0.5)
    await child.start()
    await child.stop()
    assert child.proc is not None and child.proc.returncode == -signal.SIGKILL
    assert "replica 3 did not stop within 0.5 s of SIGTERM: killed" in capfd.readouterr().err


async def test_a_child_waiting_to_be_restarted_is_counted_as_restarting() -> None:
    """A reload's answer counted a child that had exited and waited for its restart nowhere
    (QA: `{"count": 3, "told": 1}`, one process unaccounted for): it reads the file as it
    starts, and says so as `restarting`."""
    listening = "print('listening on http://127.0.0.1:1', flush=True); import time; time.sleep(60)"
    child = _Child(4, [sys.executable, "-c", listening], dict(os.environ), stop_timeout_s=5)
    await child.start()
    assert child.reload() == "told"  # SIGHUP's default ends the stand-in: as a crash would
    assert child.proc is not None
    await asyncio.wait_for(child.proc.wait(), 10)
    assert child.reload() == "restarting"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not reaped yet, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _signalled_while_starting(
    proc: asyncio.subprocess.Process, sig: signal.Signals, children: int
) -> tuple[str, list[int]]:
    """Send `sig` to `proc` once it has spawned `children` replicas (none listening yet; SIGINT
    to its whole group, as Ctrl-C), and return what it and they said until all were gone, and
    the children's pids."""
    assert proc.stdout is not None
    try:

        def spawned() -> bool:
            return sum(_replica(pid) for pid in _children(proc.pid)) == children

        await eventually(_true(spawned), 60, f"{children} replicas spawned")
        kids = [pid for pid in _children(proc.pid) if _replica(pid)]
        if sig is signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal's whole group, children too
        else:
            proc.send_signal(sig)
        # the output's end: every writer (the parent and each child) closed it
        out = (await asyncio.wait_for(proc.stdout.read(), 90)).decode(errors="replace")
        await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out, kids


def _replica(pid: int) -> bool:
    """Whether `pid` is a replica child whose interpreter is up (importing kvroute, its own
    handlers not up yet): a signal before that ends it by the default action, silently."""
    try:
        if b"--reuse-port" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # it ended as it was read
        return False
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    return bool(ignored & (1 << (signal.SIGPIPE - 1)))  # Python ignores it as it starts


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
async def test_a_signal_while_the_replicas_start_stops_them_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The handler came once every child listened: a SIGTERM before (the first ~1.3 s) killed
    the parent by its default action (exit -15), and its children lived on a few seconds,
    each printing a BrokenPipeError traceback as it said where it listened. The handlers are
    up before the first child starts: the children are stopped, the parent exits 0. Ctrl-C
    to the terminal's group reached the children too, still importing: each died of a
    KeyboardInterrupt traceback. They run in a session of their own now (the parent stops
    them)."""
    config = tmp_path / "router.toml"
    async with NatsServer() as nats, ReferenceWorker(ReferenceConfig(time_scale=0.0)) as worker:
        config.write_text(_one_worker_cluster(nats.url, worker.url))
        proc = await _kvroute(
            "serve", "--config", str(config), "--processes", "2", session=True
        )  # fmt: skip
        out, kids = await _signalled_while_starting(proc, sig, 2)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "BrokenPipe" not in out, out
    assert f"{sig.name} while starting" in out, out
    assert not [pid for pid in kids if _alive(pid)], out


async def test_a_sigterm_while_up_starts_its_replicas_and_relay_stops_everything() -> None:
    """As above, for `kvroute up --replicas 2 --relay`: its workers, relay and nats-server
    in-process or its own, its replicas children."""
    proc = await _kvroute(
        "up", "--workers", "1", "--replicas", "2", "--relay", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
    )  # fmt: skip
    out, kids = await _signalled_while_starting(proc, signal.SIGTERM, 2)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "BrokenPipe" not in out, out
    assert "SIGTERM while starting" in out and "stopped" in out, out
    assert not [pid for pid in kids if _alive(pid)], out


async def test_replicas_whose_parent_is_killed_while_they_start_stop_quietly(
    tmp_path: Path,
) -> None:
    """A parent killed (SIGKILL: no chance to stop anyone) while its children imported: each
    took its new parent (init, a subreaper) for the one to outlive and served on, orphaned,
    for good, or printed a BrokenPipeError traceback saying where it listened. They get
    SIGTERM when the parent dies now, and that print is let go quietly."""
    config = tmp_path / "router.toml"
    async with NatsServer() as nats, ReferenceWorker(ReferenceConfig(time_scale=0.0)) as worker:
        config.write_text(_one_worker_cluster(nats.url, worker.url))
        proc = await _kvroute("serve", "--config", str(config), "--processes", "2")
        try:
            out, kids = await asyncio.wait_for(
                _signalled_while_starting(proc, signal.SIGKILL, 2), 30
            )
        finally:
            for pid in _running(str(config)):  # orphans: nobody else stops them
                os.kill(pid, signal.SIGKILL)
    assert len(kids) == 2 and not [pid for pid in kids if _alive(pid)], out
    assert "Traceback" not in out and "BrokenPipe" not in out, out


def _running(word: str) -> list[int]:
    """The processes whose command line has `word`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if word.encode() in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


@pytest.mark.parametrize("level", [None, "info"], ids=["default", "info"])
async def test_up_with_a_relay_alone_says_it_in_the_singular_and_passes_its_log_level(
    level: str | None,
) -> None:
    """`kvroute up --workers 1 --relay` said "1 reference workers" and "1 router replica
    processes"; `up` had no --log-level and held its replicas to WARNING. It takes one now,
    passed on to its replicas (left out: WARNING, as before)."""
    proc = await _kvroute(
        "up", "--workers", "1", "--relay", "--router-port", "0", "--worker-port-base", "0",
        "--time-scale", "0", *(["--log-level", level] if level else []),
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C stops the router", lines), 60)
        # the replica's first INFO line comes as it starts, before it listens
    told = "".join(lines)
    assert "1 reference worker (" in told and "1 reference workers" not in told, told
    assert "1 router replica process listening on" in told, told
    assert ("INFO process=0 router.commands.serve" in told) == (level == "info"), told
