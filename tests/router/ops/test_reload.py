"""Reload without a restart, through real sockets: a router, reference workers, a config file.

`POST /admin/reload` (and SIGHUP in `kvroute serve`, in a real process) re-read the file:
workers added and removed, a policy weight, a limit; a stream in flight across the reload ends
intact; an invalid file is a 400 naming the key and the running config keeps serving.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.config import RouterConfig, load_config
from router.http.reload import ConfigSource
from router.http.reload_link import ProcessesTold, ReloadLink, answer_child
from router.service import RouterService
from tests.router.conftest import (
    AUTH,
    TOKEN,
    DiscoveryGate,
    Fleet,
    HungDiscovery,
    eventually,
)
from tests.subprocesses import ends_on_sigint
from workers.config import DEFAULT_MODEL
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PROMPT = "The quarterly report of the ACME support desk, section one. " * 4


def _toml(workers: dict[str, str], *, hit_weight: float = 4.0, salt_bytes: int = 256) -> str:
    """A router config: loopback, free port, admin token, quick health rounds, `workers`."""
    lines = [
        "[listen]",
        'host = "127.0.0.1"',
        "port = 0",
        "[admin]",
        f'token = "{TOKEN}"',
        "[health]",
        "interval_s = 0.2",
        "timeout_s = 0.5",
        "[policy]",
        f"hit_weight = {hit_weight}",
        "[limits]",
        f"max_salt_bytes = {salt_bytes}",
    ]
    for wid, url in workers.items():
        lines += ["[[workers]]", f'id = "{wid}"', f'url = "{url}"']
    return "\n".join(lines) + "\n"


class Reloadable(Fleet):
    """A fleet whose router was read from `path` (rewrite it, then `reload`)."""

    path: Path
    spare: ReferenceWorker

    async def reload(self) -> tuple[int, Any]:
        return await self.admin("POST", "/reload")


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Reloadable]:
    """w0 and w1 in the file, w2 running but not in it; decode is slow enough (20 ms a token)
    for a stream to be in flight across a reload."""
    cfg = ReferenceConfig(
        time_scale=1.0, page_size=16, prefill_ms_per_token=0.0, decode_ms_per_token=20.0
    )
    async with (
        ReferenceWorker(cfg) as w0,
        ReferenceWorker(cfg) as w1,
        ReferenceWorker(cfg) as w2,
    ):
        path = tmp_path / "router.toml"
        path.write_text(_toml({"w0": w0.url, "w1": w1.url}))
        source = ConfigSource(str(path), lambda: load_config(path, reloading=True))
        async with (
            RouterService(source.load(), config_source=source) as router,
            aiohttp.ClientSession() as session,
        ):
            fleet = Reloadable(router, {"w0": w0, "w1": w1}, session)
            fleet.path = path
            fleet.spare = w2
            await fleet.warm()
            yield fleet


def _chat(salt: str, *, max_tokens: int = 1, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "cache_salt": salt,
    }
    if stream:
        body["stream"] = True
    return body


async def _held_hit(fleet: Fleet, body: dict[str, Any], hit_weight: float) -> float:
    """The best prefix hit any candidate offers, each candidate's score checked against
    `hit_weight` (kv: score = hit_weight * hit - load)."""
    plan = await fleet.route(body)
    for c in plan["candidates"]:
        assert c["score"] == pytest.approx(hit_weight * c["hit_tokens"] - c["load"]), c
    return max(float(c["hit_tokens"]) for c in plan["candidates"])


async def test_reload_adds_a_worker_changes_a_weight_and_a_limit_while_a_stream_flows(
    fleet: Reloadable,
) -> None:
    long_salt = _chat("tenant-" + "s" * 40)  # 47 bytes: fine now, over the limit after
    status, _, _ = await fleet.post("/v1/chat/completions", long_salt)
    assert status == 200
    warm = _chat("tenant-w")
    status, headers, _ = await fleet.post("/v1/chat/completions", warm)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(warm, holder, 160), what="the prefix indexed")
    assert await _held_hit(fleet, warm, 4.0) >= 160

    # a stream in flight: 40 tokens at 20 ms each, its first chunk read before the reload
    stream_body = _chat("tenant-stream", max_tokens=40, stream=True)
    async with fleet.session.post(fleet.url + "/v1/chat/completions", json=stream_body) as resp:
        assert resp.status == 200
        streamed_by = resp.headers["x-kvroute-worker"]
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        # the file now: the worker serving the stream removed, w2 added, a weight, a limit
        kept = "w1" if streamed_by == "w0" else "w0"
        fleet.path.write_text(
            _toml(
                {kept: fleet.workers[kept].url, "w2": fleet.spare.url},
                hit_weight=2.0,
                salt_bytes=32,
            )
        )
        status, answer = await fleet.reload()
        assert status == 200, answer
        assert answer["workers_added"] == ["w2"]
        assert answer["workers_removed"] == [streamed_by]
        assert answer["changed"] == ["policy.hit_weight", "limits.max_salt_bytes"]
        assert answer["needs_restart"] == []
        # the rest of the stream, from a worker no longer in the pool, arrives intact
        rest = [line async for line in resp.content]
    events = [first, *rest]
    data = [line[6:].strip() for line in events if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert finish[-1] == "length" and len(text) > 0
    async with fleet.session.post(
        fleet.workers[streamed_by].url + "/v1/chat/completions", json=stream_body
    ) as direct:
        direct_data = [line async for line in direct.content if line.startswith(b"data: ")]
    direct_text = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in (json.loads(d[6:]) for d in direct_data[:-1])
        if c["choices"]
    )
    assert text == direct_text  # the same deterministic answer, every token of it

    _, listed = await fleet.admin("GET", "/workers")
    assert sorted(w["id"] for w in listed["workers"]) == sorted([kept, "w2"])
    # the new limit: the same 47-byte salt is now a 400 naming the limit
    status, _, error = await fleet.post("/v1/chat/completions", long_salt)
    assert status == 400 and "max_salt_bytes" in error["error"]["message"]
    # the new weight: a held prefix scores 2.0 a token (held again if its holder left)
    status, headers, _ = await fleet.post("/v1/chat/completions", warm)
    assert status == 200
    now_held = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(warm, now_held, 160), what="the prefix indexed")
    assert await _held_hit(fleet, warm, 2.0) >= 160

    # the new worker takes traffic: fresh prompts until one lands on it
    prompts = itertools.count()

    async def w2_served() -> bool:
        body = {"model": "m", "prompt": f"fresh {next(prompts)}", "max_tokens": 1}
        status, headers, _ = await fleet.post("/v1/completions", body)
        assert status == 200
        return headers["x-kvroute-worker"] == "w2"

    await eventually(w2_served, what="a request routed to the added worker")


async def test_an_invalid_file_is_a_400_naming_the_key_and_the_old_config_serves(
    fleet: Reloadable,
) -> None:
    before = fleet.router.running_config
    fleet.path.write_text(
        _toml({"w0": fleet.workers["w0"].url}, salt_bytes=8).replace(
            "hit_weight = 4.0", 'hit_weight = "heavy"'
        )
    )
    status, answer = await fleet.reload()
    assert status == 400, answer
    assert answer["error"]["type"] == "ReloadError"
    assert answer["error"]["key"] == "policy.hit_weight"
    assert "policy.hit_weight" in answer["error"]["message"]
    assert fleet.router.running_config is before
    _, listed = await fleet.admin("GET", "/workers")
    assert sorted(w["id"] for w in listed["workers"]) == ["w0", "w1"]  # w1 not removed
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("x" * 40))  # old limit
    assert status == 200

    fleet.path.write_text(_toml({"w0": fleet.workers["w0"].url}) + "[policy]\nnmae = 'kv'\n")
    status, answer = await fleet.reload()
    assert status == 400  # TOML: a table given twice
    assert answer["error"]["kept"] == "running config"

    fleet.path.write_text(
        _toml({"w0": fleet.workers["w0"].url}).replace("[policy]", "[policy]\nnmae = 'kv'")
    )
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["key"] == "policy.nmae"

    # a salt header no request can carry (the gateway's override would never apply), and an
    # admin token of spaces (no request's Bearer could carry it: the next reload locked out)
    fleet.path.write_text('salt_header = "X Salt: bad"\n' + _toml({"w0": fleet.workers["w0"].url}))
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["key"] == "salt_header", answer
    fleet.path.write_text(_toml({"w0": fleet.workers["w0"].url}).replace(TOKEN, "   "))
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["key"] == "admin.token", answer
    # a table's own check names the field, not the table (before: `workers[2]`, `policy`)
    urls = {"w0": fleet.workers["w0"].url, "w1": fleet.workers["w1"].url, "w2": "ftp://x"}
    fleet.path.write_text(_toml(urls))
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["key"] == "workers[2].url", answer
    assert "at `$.workers[2].url`" in answer["error"]["message"]
    fleet.path.write_text(_toml({"w0": urls["w0"]}, hit_weight=float("inf")))
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["key"] == "policy.hit_weight", answer
    assert fleet.router.running_config is before


async def test_a_file_that_is_not_utf8_is_a_400_naming_it_and_the_old_config_serves(
    fleet: Reloadable,
) -> None:
    before = fleet.router.running_config
    fleet.path.write_bytes(b"\xff\xfe" + _toml({"w0": fleet.workers["w0"].url}).encode())
    status, answer = await fleet.reload()
    assert status == 400, answer
    assert answer["error"]["type"] == "ReloadError"
    assert answer["error"]["kept"] == "running config"
    message = answer["error"]["message"]
    assert str(fleet.path) in message and "not UTF-8" in message and "offset 0" in message
    assert fleet.router.running_config is before
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        # a save caught after the opening comments every shipped config starts with: before,
        # it parsed as a config of defaults, and every worker was removed
        (b"# kvroute router config\n#\n# [[workers]] below\n", "has no settings"),
        # ... or after its first table header: before, `[listen]` alone was a config of
        # defaults too
        (b"# kvroute router config\n[listen]\n", "only comments or empty tables"),
        (b"[policy]\n[policy.medium_weights]\n", "only comments or empty tables"),
    ],
)
async def test_an_empty_file_is_refused_and_the_workers_stay(
    fleet: Reloadable, content: bytes, said: str
) -> None:
    # a file caught mid-save: applied, it would remove every worker
    before = fleet.router.running_config
    fleet.path.write_bytes(content)
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["type"] == "ReloadError", answer
    assert said in answer["error"]["message"], answer
    assert fleet.router.running_config is before and before.workers
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200


# nested past what anything reads: tomllib recurses per array or inline table, the settings
# check (before) per table of a dotted key, which tomllib reads without recursing
_TOO_DEEP = {
    "arrays": ("x = " + "[" * 3000 + "]" * 3000, "nest too deep to read"),
    "dotted key": (".".join(["a"] * 3000) + " = 1", "`a.a.a ... a` nests more than 32"),
}


@pytest.mark.parametrize("shape", sorted(_TOO_DEEP))
async def test_a_file_nested_too_deep_is_a_400_and_the_old_config_serves(
    fleet: Reloadable, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a RecursionError: a 500 InternalError and an ERROR traceback."""
    before = fleet.router.running_config
    nested, said = _TOO_DEEP[shape]
    fleet.path.write_text(nested + "\n" + _toml({"w0": fleet.workers["w0"].url}))
    with caplog.at_level(logging.WARNING):
        status, answer = await fleet.reload()
    assert status == 400, answer
    assert answer["error"]["type"] == "ReloadError" and answer["error"]["kept"] == "running config"
    message = answer["error"]["message"]
    assert str(fleet.path) in message and said in message, message
    assert fleet.router.running_config is before
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.levelname for r in warned] == ["WARNING"], [r.getMessage()[:200] for r in warned]
    assert said in warned[0].getMessage() and warned[0].exc_info is None
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200


async def test_a_fifo_at_the_path_is_refused_and_the_router_keeps_answering(
    fleet: Reloadable,
) -> None:
    """Before, the reload read the FIFO on the event loop: /health and every request stalled,
    and the reload never answered, until something wrote to the FIFO."""
    before = fleet.router.running_config
    fleet.path.unlink()
    os.mkfifo(fleet.path)
    status, answer = await asyncio.wait_for(fleet.reload(), 10)
    assert status == 400 and answer["error"]["type"] == "ReloadError", answer
    message = answer["error"]["message"]
    assert "is a FIFO (named pipe), not a regular file" in message and "kept" in message
    assert fleet.router.running_config is before
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200


async def test_keys_that_need_a_restart_are_reported_and_kept(fleet: Reloadable) -> None:
    port = int(fleet.url.rsplit(":", 1)[1])
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    text = text.replace("port = 0", "port = 1").replace("[policy]", '[policy]\nname = "random"')
    fleet.path.write_text(text + "[timeouts]\nrequest_s = 7.0\n")
    status, answer = await fleet.reload()
    assert status == 200, answer
    assert answer["needs_restart"] == ["listen.port", "policy.name"]
    assert answer["changed"] == ["timeouts.request_s"]
    running = fleet.router.running_config
    assert running.listen.port == 0 and running.policy.name == "kv"
    assert running.timeouts.request_s == 7.0
    assert int(fleet.url.rsplit(":", 1)[1]) == port
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200
    # said again on the next reload: the file still differs from what runs
    status, answer = await fleet.reload()
    assert answer["needs_restart"] == ["listen.port", "policy.name"] and not answer["changed"]


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "chat-templates"


async def test_a_file_a_start_would_refuse_is_refused_naming_the_key(
    fleet: Reloadable, tmp_path: Path
) -> None:
    """Restart-only keys are kept at their running value, and before only the parse was
    checked: a tokenizer file that does not exist, or the admin API off loopback without a
    token, was a 200 listing the key under `needs_restart`, and the next restart (a
    `--processes` child's after a crash) exited 2 on it. The reload refuses what a start
    refuses, by the key."""
    pytest.importorskip("tokenizers")
    before = fleet.router.running_config
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    refused = {
        "tokenizer.path": text + '[tokenizer]\nkind = "hf"\npath = "/nonexistent/tokenizer.json"\n',
        "tokenizer.chat_template": text + '[tokenizer]\nchat_template = "/nonexistent.jinja"\n',
        "admin.token": text.replace('host = "127.0.0.1"', 'host = "0.0.0.0"').replace(
            f'token = "{TOKEN}"', ""
        ),
    }
    for key, refused_text in refused.items():
        fleet.path.write_text(refused_text)
        status, answer = await fleet.reload()
        assert status == 400, (key, answer)
        assert answer["error"]["key"] == key, answer
        assert answer["error"]["kept"] == "running config"
        assert fleet.router.running_config is before
    assert "/nonexistent/tokenizer.json" in (await _refusal(fleet, refused["tokenizer.path"]))
    assert "without a token" in (await _refusal(fleet, refused["admin.token"]))
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("t"))
    assert status == 200

    # a tokenizer a start loads is reloaded as before: kept for a restart, said so
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((FIXTURES / "qwen3-0.6b" / "tokenizer.json").read_bytes())
    loadable = f'[tokenizer]\nkind = "hf"\npath = "{hf / "tokenizer.json"}"\n'
    fleet.path.write_text(text + loadable + "[timeouts]\nrequest_s = 7.0\n")
    status, answer = await fleet.reload()
    assert status == 200, answer
    assert answer["needs_restart"] == ["tokenizer.kind", "tokenizer.path"], answer
    assert answer["changed"] == ["timeouts.request_s"], answer
    assert fleet.router.running_config.tokenizer.kind == "byte"


async def _refusal(fleet: Reloadable, text: str) -> str:
    """The message of the reload of `text`, which must be refused."""
    fleet.path.write_text(text)
    status, answer = await fleet.reload()
    assert status == 400, answer
    return str(answer["error"]["message"])


async def test_a_file_adding_a_server_an_admin_added_changes_nothing(fleet: Reloadable) -> None:
    """Checked before anything applies: before, the limit changed, the worker was not added,
    and the next reload of the same file said nothing changed."""
    spare = fleet.spare.url
    status, _ = await fleet.admin("POST", "/workers", {"id": "extra", "url": spare})
    assert status == 201
    before = fleet.router.running_config
    workers = {n: w.url for n, w in fleet.workers.items()} | {"w2": spare}
    fleet.path.write_text(_toml(workers, salt_bytes=4))
    status, answer = await fleet.reload()
    assert status == 400 and answer["error"]["type"] == "ReloadError", answer
    assert answer["error"]["key"] == "workers" and "'extra'" in answer["error"]["message"]
    assert fleet.router.running_config is before
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("tenant-long-salt"))
    assert status == 200  # the limit of the refused file is not in force
    # once the admin's worker is gone the same file applies whole
    status, _ = await fleet.admin("DELETE", "/workers/extra")
    assert status == 200
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_added"] == ["w2"], answer


async def test_a_worker_on_another_workers_stream_is_not_a_second_candidate(
    fleet: Reloadable,
) -> None:
    """A file's worker whose KV events are the stream of the worker an admin added (a
    copy-pasted `events`, or one server under a name the config cannot read as its address)
    was registered `ready` and routed by load beside it (one engine, two candidates, each
    with half its load), though its streams were refused as the other's. A worker whose KV
    events are another worker's stream is that worker: `duplicate`, sent nothing.
    (`localhost` beside its address is refused at validation: the next test.)"""
    spare = fleet.spare
    status, _ = await fleet.admin("POST", "/workers", {"id": "extra", "url": spare.url})
    assert status == 201
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as other:
        workers = {n: w.url for n, w in fleet.workers.items()} | {"y": other.url}
        events = f'events = "{spare.kv_events.endpoints[0]}"\nblock_size = 16\n'
        fleet.path.write_text(_toml(workers) + events)
        status, answer = await fleet.reload()
        assert status == 200 and answer["workers_added"] == ["y"], answer
        assert "worker extra's stream already" in answer["not_registered"]["y"], answer

        async def said_duplicate() -> bool:  # after its first health round too
            _, listed = await fleet.admin("GET", "/workers")
            row = next(w for w in listed["workers"] if w["id"] == "y")
            # `duplicate` once checked (before: `checking`), and healthy: `ready` but for it
            return bool(row["status"] == "duplicate" and row["healthy"])

        await eventually(said_duplicate, what="y told apart as extra's duplicate")
        plan = await fleet.route(_chat("tenant-dup"))
        (listed,) = [c for c in plan["candidates"] if c["worker"] == "y"]
        assert listed["status"] == "duplicate" and not listed["healthy"], listed  # not chosen
        # the admin's worker gone, the file's is the stream's one entry, and routed
        status, _ = await fleet.admin("DELETE", "/workers/extra")
        assert status == 200

        async def routable() -> bool:
            _, listed = await fleet.admin("GET", "/workers")
            return any(w["id"] == "y" and w["status"] == "ready" for w in listed["workers"])

        await eventually(routable, what="y registered once extra left")


async def test_localhost_beside_its_address_is_refused_as_one_server(fleet: Reloadable) -> None:
    """A file listing `http://localhost:P/` beside `http://127.0.0.1:P` answered 200 (the
    second `duplicate` once registered) while the same spelling twice is a 400: both are a
    400 now, the running config kept; so is the file's localhost beside an admin's address."""
    before = fleet.router.running_config
    w0 = fleet.workers["w0"].url
    for alias in (w0, w0.replace("http://127.0.0.1:", "http://localhost:") + "/"):
        fleet.path.write_text(_toml({"w0": w0, "w1": fleet.workers["w1"].url, "y": alias}))
        status, answer = await fleet.reload()
        assert status == 400 and answer["error"]["type"] == "ReloadError", answer
        assert "'w0' and 'y' are one server" in answer["error"]["message"], answer
        assert fleet.router.running_config is before
    status, _ = await fleet.admin("POST", "/workers", {"id": "extra", "url": fleet.spare.url})
    assert status == 201
    alias = fleet.spare.url.replace("http://127.0.0.1:", "http://localhost:")
    fleet.path.write_text(_toml({n: w.url for n, w in fleet.workers.items()} | {"y": alias}))
    status, answer = await fleet.reload()
    assert status == 400 and "'extra'" in answer["error"]["message"], answer
    assert fleet.router.running_config is before


async def test_the_answer_names_the_workers_that_could_not_be_registered(
    fleet: Reloadable,
) -> None:
    """Added, but down (or refused): in the pool, retried every health round, and routed to
    (by load alone, if its streams cannot be had) only once a round finds it up. Before, only
    the log said so, the answer looked like a clean add, and it was `ready` until the next
    round: its requests failed (502 with no retries left)."""
    workers = {n: w.url for n, w in fleet.workers.items()} | {"w9": "http://127.0.0.1:9"}
    fleet.path.write_text(_toml(workers))
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_added"] == ["w9"], answer
    assert list(answer["not_registered"]) == ["w9"] and answer["not_registered"]["w9"]
    _, listed = await fleet.admin("GET", "/workers")
    row = next(w for w in listed["workers"] if w["id"] == "w9")
    assert row["status"] in ("checking", "unhealthy") and not row["healthy"], row
    fleet.path.write_text(_toml(workers | {"w2": fleet.spare.url}))
    status, answer = await fleet.reload()
    assert answer["workers_added"] == ["w2"] and answer["not_registered"] == {}, answer


async def test_a_fleet_swapped_whole_in_one_reload_serves_throughout(fleet: Reloadable) -> None:
    """The new worker is added, and checked, before the old ones go. Before, the old ones
    went first: until the new one was discovered its model was served by nobody, and requests
    naming it got 404 model_not_found (which OpenAI clients do not retry)."""
    named = {**_chat("t"), "model": DEFAULT_MODEL}
    async with DiscoveryGate(fleet.spare.url) as gate:
        fleet.path.write_text(_toml({"w2": gate.url}))
        reload = asyncio.create_task(fleet.reload())

        async def discovering() -> bool:
            return gate.info_asked >= 1

        await eventually(discovering, what="the new worker's discovery")
        for _ in range(4):  # while it is discovered: the old workers serve
            status, headers, answer = await fleet.post("/v1/chat/completions", named)
            assert status == 200, answer
            assert headers["x-kvroute-worker"] in ("w0", "w1")
        _, listed = await fleet.admin("GET", "/workers")
        assert {w["id"]: w["status"] for w in listed["workers"]} == {
            "w0": "ready",
            "w1": "ready",
            "w2": "checking",
        }
        gate.open.set()
        status, answer = await reload
        assert status == 200, answer
        assert (answer["workers_added"], answer["workers_removed"]) == (["w2"], ["w0", "w1"])
        status, headers, answer = await fleet.post("/v1/chat/completions", named)
        assert status == 200 and headers["x-kvroute-worker"] == "w2", answer


async def _registered_as(fleet: Reloadable, gate: DiscoveryGate, worker_id: str) -> None:
    """The gated server reloaded in as `worker_id`, its discovery let through."""
    gate.open.set()
    fleet.path.write_text(_toml({worker_id: gate.url}))
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_added"] == [worker_id], answer


async def _renaming_to(
    fleet: Reloadable, gate: DiscoveryGate, worker_id: str
) -> asyncio.Task[tuple[int, Any]]:
    """A reload of the gated server under the id `worker_id`, under way: its discovery asked
    and held (a rename's discovery that takes a while)."""
    gate.open.clear()
    asked = gate.info_asked
    fleet.path.write_text(_toml({worker_id: gate.url}))
    reload = asyncio.create_task(fleet.reload())

    async def discovering() -> bool:
        return gate.info_asked > asked

    await eventually(discovering, what="the new id's discovery")
    return reload


async def test_requests_during_a_rename_are_served_by_the_new_id(fleet: Reloadable) -> None:
    """The same server under a new id: its old id goes before the new one is added, discovered
    and checked (one server is one worker in the pool). Before, the requests of that gap were
    refused: a 404 `UnknownModelError` listing no model (which OpenAI clients do not retry),
    then 503s while the new id was discovered and checked. Now they wait for the reload's
    change to end, and the new id serves them."""
    named = {**_chat("t"), "model": DEFAULT_MODEL}
    async with DiscoveryGate(fleet.spare.url) as gate:
        await _registered_as(fleet, gate, "wA")
        status, headers, answer = await fleet.post("/v1/chat/completions", named)
        assert status == 200 and headers["x-kvroute-worker"] == "wA", answer
        reload = await _renaming_to(fleet, gate, "wX")
        # wA is gone, wX not registered: the fleet serves nothing for now
        _, listed = await fleet.admin("GET", "/workers")
        assert {w["id"]: w["status"] for w in listed["workers"]} == {"wX": "checking"}
        sent = [asyncio.create_task(fleet.post("/v1/chat/completions", named)) for _ in range(3)]
        unnamed = {"prompt": PROMPT, "max_tokens": 1}
        sent.append(asyncio.create_task(fleet.post("/v1/completions", unnamed)))
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in sent), [t.result() for t in sent if t.done()]
        gate.open.set()
        status, answer = await reload
        assert status == 200, answer
        assert (answer["workers_added"], answer["workers_removed"]) == (["wX"], ["wA"])
        for status, headers, answer in await asyncio.gather(*sent):
            assert status == 200 and headers["x-kvroute-worker"] == "wX", answer


async def test_a_kv_query_during_a_rename_is_answered_by_the_new_id(fleet: Reloadable) -> None:
    """`/v1/kv/query` waits for the change as the proxy does. Before, a query in the rename's
    gap got a 404 `UnknownModelError` listing no model (QA: 1 of 80)."""
    query = {"model": DEFAULT_MODEL, "text": PROMPT}
    async with DiscoveryGate(fleet.spare.url) as gate:
        await _registered_as(fleet, gate, "wA")
        reload = await _renaming_to(fleet, gate, "wX")
        sent = asyncio.create_task(fleet.post("/v1/kv/query", query))
        await asyncio.sleep(0.2)
        assert not sent.done(), sent.result()
        gate.open.set()
        status, _, answer = await sent
        assert status == 200, answer
        assert [row["worker"] for row in answer["workers"]] == ["wX"]
        assert (await reload)[0] == 200


async def test_renames_back_and_forth_under_traffic_fail_no_request(fleet: Reloadable) -> None:
    """The QA run: clients sending all along while the file renames both workers and back.
    Before, each reload failed some of them: 404 (the pool empty for an instant), then 503."""
    named = {**_chat("t"), "model": DEFAULT_MODEL}
    urls = {wid: w.url for wid, w in fleet.workers.items()}
    renamed = {"x" + wid: url for wid, url in urls.items()}
    failed: list[tuple[int, Any]] = []
    sent = 0
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal sent
        while not stop.is_set():
            status, _, answer = await fleet.post("/v1/chat/completions", named)
            sent += 1
            if status != 200:
                failed.append((status, answer))

    clients = [asyncio.create_task(client()) for _ in range(3)]
    for workers in (renamed, urls, renamed, urls):
        fleet.path.write_text(_toml(workers))
        status, answer = await fleet.reload()
        assert status == 200 and sorted(answer["workers_added"]) == sorted(workers), answer
    stop.set()
    await asyncio.gather(*clients)
    assert sent > 0 and not failed, failed[:3]


async def test_a_model_whose_workers_are_not_known_yet_is_a_503_not_a_404(
    fleet: Reloadable,
) -> None:
    """The only worker down (its models unknown): the model may be its, so a 503 to retry.
    Before, a 404 model_not_found with an empty list of models (the model was "gone"), and a
    request naming no model was sent to the dead worker (502), later refused as a bare
    NoWorkerError (the dead worker its one pool's)."""
    fleet.path.write_text(_toml({"w9": "http://127.0.0.1:9"}))
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_removed"] == ["w0", "w1"], answer
    named = {**_chat("t"), "model": DEFAULT_MODEL}
    status, headers, answer = await fleet.post("/v1/chat/completions", named)
    assert status == 503, answer
    error = answer["error"]
    assert error["type"] == "ModelUnavailableError" and error["code"] == "model_not_available"
    assert "not known yet" in error["message"] and error["models"] == []
    assert headers["Retry-After"] == "1"  # a client told when to come back
    unnamed = {"prompt": "hi", "max_tokens": 1}
    status, headers, answer = await fleet.post("/v1/completions", unnamed)
    assert status == 503 and answer["error"]["type"] == "ModelUnavailableError", answer
    assert answer["error"]["message"].startswith("the request names no model; the models of 1")
    assert headers["Retry-After"] == "1"


async def test_the_answer_warns_of_event_sockets_the_worker_does_not_advertise(
    fleet: Reloadable,
) -> None:
    """w0 given another worker's sockets (a typo, or the sockets of a worker removed in the
    same edit): registered (the ports may be mapped on the way), but its streams predict no
    hit until proven. Before, the stream stayed `unverified` and nothing said why."""
    spare = fleet.spare.kv_events
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    w0_line = f'url = "{fleet.workers["w0"].url}"\n'
    wrong = f'events = "{spare.endpoint}"\nreplay = "{spare.replay_endpoint}"\n'
    fleet.path.write_text(text.replace(w0_line, w0_line + wrong))
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_changed"] == ["w0"], answer
    assert answer["not_registered"] == {}
    assert list(answer["warnings"]) == ["w0"], answer
    warning = answer["warnings"]["w0"]
    assert "advertises event sockets" in warning and spare.endpoint in warning
    fleet.path.write_text(text)  # fixed: nothing to warn of
    status, answer = await fleet.reload()
    assert answer["workers_changed"] == ["w0"] and answer["warnings"] == {}, answer


async def test_the_answer_warns_of_a_block_size_the_worker_does_not_advertise(
    fleet: Reloadable,
) -> None:
    """w1 configured with 32-token blocks, its pages 16: registered (the config overrides), but
    none of its events' pages would fit. Before, only the indexer said so, at its first event
    (BLOCK SIZE MISMATCH), and the reload's answer warned of nothing."""
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    fleet.path.write_text(text + "block_size = 32\n")  # the last worker's (w1)
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_changed"] == ["w1"], answer
    assert answer["not_registered"] == {}
    assert list(answer["warnings"]) == ["w1"], answer
    warning = answer["warnings"]["w1"]
    assert "block_size 32" in warning and "page size 16" in warning, warning
    fleet.path.write_text(text + "block_size = 16\n")  # what it advertises: nothing to warn of
    status, answer = await fleet.reload()
    assert answer["workers_changed"] == ["w1"] and answer["warnings"] == {}, answer


async def test_the_answer_warns_of_a_role_the_worker_contradicts(fleet: Reloadable) -> None:
    """w1 configured as a decode worker, which does both (SGLang's disaggregation_mode
    "null"): routed as the config says, but every pair through it would fail. Before, only the
    log said so; the reload's answer warned of nothing (QA)."""
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    fleet.path.write_text(text + 'role = "decode"\n')  # the last worker's (w1)
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_changed"] == ["w1"], answer
    assert list(answer["warnings"]) == ["w1"], answer
    warning = answer["warnings"]["w1"]
    assert "the config says role 'decode', the worker advertises 'both'" in warning, warning
    fleet.path.write_text(text)  # its own role: nothing to warn of
    status, answer = await fleet.reload()
    assert answer["workers_changed"] == ["w1"] and answer["warnings"] == {}, answer


async def test_a_drained_worker_stays_drained_when_a_reload_changes_it(fleet: Reloadable) -> None:
    status, _ = await fleet.admin("POST", "/workers/w1/drain")
    assert status == 200
    text = _toml({n: w.url for n, w in fleet.workers.items()})
    fleet.path.write_text(text + 'model = "m"\n')  # the last worker (w1) gains a model name
    status, answer = await fleet.reload()
    assert status == 200 and answer["workers_changed"] == ["w1"], answer
    assert fleet.router.planner.pool.get("w1").draining
    _, listed = await fleet.admin("GET", "/workers")
    assert {w["id"]: w["draining"] for w in listed["workers"]}["w1"] is True


async def test_a_drained_worker_renamed_stays_drained_under_its_new_id(
    fleet: Reloadable,
) -> None:
    """The drain follows the server: before, the new id came up ready, and traffic went back
    to a server drained for maintenance; a server new to the pool is not drained."""
    status, _ = await fleet.admin("POST", "/workers/w1/drain")
    assert status == 200
    urls = {n: w.url for n, w in fleet.workers.items()}
    fleet.path.write_text(_toml({"w0": urls["w0"], "w1-new": urls["w1"], "w2": fleet.spare.url}))
    status, answer = await fleet.reload()
    assert status == 200, answer
    assert sorted(answer["workers_added"]) == ["w1-new", "w2"], answer
    assert answer["workers_removed"] == ["w1"], answer
    pool = fleet.router.planner.pool
    assert pool.get("w1-new").draining and not pool.get("w2").draining
    _, listed = await fleet.admin("GET", "/workers")
    drains = {w["id"]: w["draining"] for w in listed["workers"]}
    assert drains == {"w0": False, "w1-new": True, "w2": False}, drains
    for i in range(4):  # none of them reaches the drained server
        status, headers, _ = await fleet.post("/v1/chat/completions", _chat(f"after-{i}"))
        assert status == 200 and headers["x-kvroute-worker"] != "w1-new"


async def test_a_drain_follows_its_server_when_a_reload_swaps_two_ids(
    fleet: Reloadable,
) -> None:
    """w1's server drained, then a file that gives w0's server to w1 and w1's to w0. Before,
    the drain stayed with the id: w1, now on the healthy server, was drained, and w0, now on
    the server under maintenance, came up ready and took traffic."""
    status, _ = await fleet.admin("POST", "/workers/w1/drain")
    assert status == 200
    urls = {n: w.url for n, w in fleet.workers.items()}
    fleet.path.write_text(_toml({"w0": urls["w1"], "w1": urls["w0"]}))
    status, answer = await fleet.reload()
    assert status == 200 and sorted(answer["workers_changed"]) == ["w0", "w1"], answer
    pool = fleet.router.planner.pool
    assert pool.get("w0").draining and not pool.get("w1").draining
    assert pool.get("w0").url == urls["w1"].rstrip("/")
    for i in range(4):  # none of them reaches the drained server
        status, headers, _ = await fleet.post("/v1/chat/completions", _chat(f"swapped-{i}"))
        assert status == 200 and headers["x-kvroute-worker"] == "w1"


async def test_reload_needs_a_config_file_and_the_admin_token() -> None:
    from tests.router.conftest import router_config

    async with RouterService(router_config([])) as router, aiohttp.ClientSession() as s:
        async with s.post(router.url + "/admin/reload") as resp:
            assert resp.status == 401
        async with s.post(router.url + "/admin/reload", headers=AUTH) as resp:
            assert resp.status == 400
            assert "no config file to read again" in (await resp.json())["error"]["message"]


async def test_sighup_reloads_kvroute_serve(tmp_path: Path) -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        path = tmp_path / "router.toml"
        path.write_text(_toml({"w0": w0.url}))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "router.commands.cli", "serve", "--config", str(path)),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        async with ends_on_sigint(proc):
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            url = line.split("listening on ")[1].split()[0]
            async with aiohttp.ClientSession(headers=AUTH) as session:

                async def workers() -> list[str]:
                    async with session.get(url + "/admin/workers") as resp:
                        return sorted(w["id"] for w in (await resp.json())["workers"])

                assert await workers() == ["w0"]
                path.write_text(_toml({"w0": w0.url, "w1": w1.url}, salt_bytes=64))
                proc.send_signal(signal.SIGHUP)
                reloaded = await _log_line(proc.stderr, "config reloaded")
                assert "workers added: w1" in reloaded and "limits.max_salt_bytes" in reloaded
                assert await workers() == ["w0", "w1"]

                path.write_text("[policy]\nhit_weight = -1\n")
                proc.send_signal(signal.SIGHUP)
                refused = await _log_line(proc.stderr, "reload refused")
                assert "policy.hit_weight" in refused
                assert await workers() == ["w0", "w1"]  # nothing removed

                path.write_bytes(b"\xff\xfe[listen]\n")  # UTF-16, say
                proc.send_signal(signal.SIGHUP)
                refused = await _log_line(proc.stderr, "reload refused")
                assert str(path) in refused and "not UTF-8" in refused
                assert await workers() == ["w0", "w1"]

                # before, "Task exception was never retrieved" and a RecursionError's traceback
                path.write_text(".".join(["a"] * 3000) + " = 1\n" + _toml({"w0": w0.url}))
                proc.send_signal(signal.SIGHUP)
                refused = await _log_line(proc.stderr, "reload refused")
                assert "WARNING" in refused and "nests more than 32" in refused, refused
                assert await workers() == ["w0", "w1"]


async def test_a_sighup_reload_that_fails_otherwise_is_logged_once_as_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload failing with anything but a ConfigError (a defect): `kvroute serve`'s SIGHUP
    task logs it once, with its traceback. Before, only ConfigError was caught and nobody
    awaited the task: asyncio's "Task exception was never retrieved", at garbage collection.
    The fault is the file loader's, as a RecursionError from a nested file was."""
    from router.commands.serve import _reload

    path = tmp_path / "router.toml"
    path.write_text(_toml({}))

    def broken() -> RouterConfig:
        raise RuntimeError("a defect of the loader")

    source = ConfigSource(str(path), broken)
    async with RouterService(load_config(path), config_source=source) as router:
        before = router.running_config
        with caplog.at_level(logging.WARNING):
            task = asyncio.get_running_loop().create_task(_reload(router))
            await asyncio.wait({task}, timeout=10)
        assert task.done() and task.exception() is None
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [(r.levelname, r.getMessage()) for r in errors] == [
            ("ERROR", "config reload on SIGHUP failed")
        ]
        assert errors[0].exc_info is not None and "a defect" in str(errors[0].exc_info[1])
        assert router.running_config is before


async def _log_line(stream: asyncio.StreamReader, marker: str) -> str:
    """The next line of the router's log that contains `marker`."""
    async with asyncio.timeout(30):
        while True:
            line = (await stream.readline()).decode(errors="replace")
            if not line:
                raise AssertionError(f"the router's log ended before {marker!r}")
            if marker in line:
                return line


async def test_a_worker_whose_http_hangs_holds_no_reload(fleet: Reloadable) -> None:
    """Added by the file, it accepts and never answers its settings: the reload answers once
    it waited `ADD_WAIT_TIMEOUTS` health timeouts (1 s here), naming it as still being
    discovered, and the next reload is not held either. Before, a reload waited for the whole
    discovery (39 s at the default timeouts with its events spelled out), and a second one
    sent meanwhile waited for the first."""
    async with HungDiscovery() as hung:
        workers = {n: w.url for n, w in fleet.workers.items()} | {"h": hung.url}
        fleet.path.write_text(_toml(workers))
        started = time.monotonic()
        first = asyncio.create_task(fleet.reload())
        await asyncio.sleep(0.3)
        fleet.path.write_text(_toml(workers, hit_weight=5.0))
        status, second = await fleet.reload()
        took = time.monotonic() - started
        assert status == 200 and second["changed"] == ["policy.hit_weight"], second
        status, answer = await first
        assert status == 200 and answer["workers_added"] == ["h"], answer
        assert list(answer["not_registered"]) == ["h"], answer
        assert "still being discovered" in answer["not_registered"]["h"], answer
        assert took < 3.0, took  # both reloads: 1 s bound, and the answers' own time
        _, listed = await fleet.admin("GET", "/workers")
        assert {w["id"]: w["status"] for w in listed["workers"]}["h"] == "checking"
        assert hung.asked.get("/server_info") == 1  # its one discovery goes on


async def test_a_closed_reload_link_never_touches_its_old_descriptor_number(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--processes` child: the link closed at SIGTERM kept its descriptor number, and a
    reload later in the grace wrapped whatever socket held that number by then (another part
    of the router's), wrote into it, and closed it when the wrapper was collected. The warning
    told the operator to SIGHUP a parent that was stopping everything."""
    ours, theirs = socket.socketpair()
    first, second = socket.socketpair()
    with ours, first, second:
        number = theirs.detach()
        link = ReloadLink(number)
        link.close()
        os.dup2(first.fileno(), number)  # another socket takes the freed number
        with socket.socket(fileno=number) as foreign:
            told = await link.tell_siblings()
            assert told == ProcessesTold(count=None, told=0, error="shutting down")
            gc.collect()
            foreign.sendall(b"still mine")  # open, and nothing was written into it
            second.setblocking(False)
            assert second.recv(64) == b"still mine"
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "shutting down" in warning and "SIGHUP" not in warning, warning


async def test_a_late_answer_of_the_parent_is_not_taken_for_the_next_reloads() -> None:
    """A parent stalled past the wait answered later anyway: that late answer stayed in the
    socket and was taken for the next reload's, and every answer after was the one before's.
    Answers carry their question's id now; a stale one is dropped."""
    parent, child = socket.socketpair()
    link = ReloadLink(child.detach(), timeout_s=0.3)
    counter = itertools.count(1)

    def tell_others() -> ProcessesTold:
        return ProcessesTold(count=3, told=next(counter))  # each answer its own

    stalled = await link.tell_siblings()  # nobody reads the parent's end yet
    assert stalled.count is None and stalled.error == "TimeoutError", stalled
    answering = asyncio.create_task(answer_child(parent, tell_others))
    # the parent answers the stalled question (told 1) first, then this one (told 2)
    assert await link.tell_siblings() == ProcessesTold(count=3, told=2)
    assert await link.tell_siblings() == ProcessesTold(count=3, told=3)
    link.close()
    await asyncio.wait_for(answering, 5)  # the child's end closed: the parent's ends too
