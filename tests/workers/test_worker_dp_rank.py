"""How a request names its DP rank on the reference worker, as on SGLang 0.5.23.

`routed_dp_rank` in the body, else its deprecated alias `data_parallel_rank`, on every route;
the `X-Data-Parallel-Rank` header (any case) overrides the body on the OpenAI routes and is not
read on `/generate`; bad values are a 400 JSON error; no rank means the ranks take turns.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

_prompts = itertools.count()


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    config = WorkerConfig(page_size=4, capacity_tokens=4096, time_scale=0, dp_size=2)
    async with ReferenceWorker(config) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _text() -> str:
    # unique from the first page on (a chat template's opening tokens are shared, though)
    return f"{next(_prompts):06d}: a prompt for the rank tests"


async def _served_by(
    worker: ReferenceWorker,
    http: aiohttp.ClientSession,
    path: str,
    fields: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> int:
    """The rank that cached a new prompt sent to `path` with `fields` and `headers`."""
    text = _text()
    body: dict[str, Any]
    if path == "/generate":
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    elif path == "/v1/completions":
        body = {"prompt": text, "max_tokens": 1}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    async with http.post(worker.url + path, json=body | fields, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    probe = {"messages": body["messages"]} if "messages" in body else {"text": text}
    async with http.post(worker.url + "/debug/match", json=probe) as resp:
        ranks = (await resp.json())["ranks"]
    # the rank that served it holds all of it; another, at most the chat template's opening
    holder: int = ranks.index(max(ranks))
    assert min(ranks) < max(ranks) - 16, ranks
    if path == "/generate":
        assert answer["meta_info"]["dp_rank"] == holder
    return holder


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_both_body_spellings_on_every_route(
    worker: ReferenceWorker, http: aiohttp.ClientSession, path: str
) -> None:
    for rank in (1, 0, 1):
        assert await _served_by(worker, http, path, {"routed_dp_rank": rank}) == rank
        assert await _served_by(worker, http, path, {"data_parallel_rank": rank}) == rank
    # the new spelling wins over the deprecated one; a null one is no rank
    both = {"routed_dp_rank": 0, "data_parallel_rank": 1}
    assert await _served_by(worker, http, path, both) == 0
    alias = {"routed_dp_rank": None, "data_parallel_rank": 1}
    assert await _served_by(worker, http, path, alias) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_header_overrides_the_body_on_the_openai_routes(
    worker: ReferenceWorker, http: aiohttp.ClientSession, path: str
) -> None:
    for name in ("X-Data-Parallel-Rank", "x-data-parallel-rank", "X-data-parallel-rank"):
        assert await _served_by(worker, http, path, {}, {name: "1"}) == 1
        assert await _served_by(worker, http, path, {"routed_dp_rank": 1}, {name: "0"}) == 0
        assert await _served_by(worker, http, path, {"data_parallel_rank": 0}, {name: "1"}) == 1
    # int() of the value, as SGLang parses it
    assert await _served_by(worker, http, path, {}, {"X-Data-Parallel-Rank": " 1 "}) == 1


async def test_generate_reads_no_header_and_unranked_requests_take_turns(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    header = {"X-Data-Parallel-Rank": "1"}
    served = [await _served_by(worker, http, "/generate", {}, header) for _ in range(4)]
    assert sorted(served) == [0, 0, 1, 1] and served[0] != served[1]


async def test_bad_ranks_are_400_json(worker: ReferenceWorker, http: aiohttp.ClientSession) -> None:
    text = {"text": "a"}
    prompt = {"prompt": "a", "max_tokens": 1}
    cases: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
        ("/generate", text | {"routed_dp_rank": 2}, {}, "out of range [0, 2)"),
        ("/generate", text | {"routed_dp_rank": -1}, {}, "out of range"),
        ("/generate", text | {"data_parallel_rank": 5}, {}, "out of range"),
        ("/generate", text | {"routed_dp_rank": "1"}, {}, "routed_dp_rank must be an integer"),
        ("/generate", text | {"data_parallel_rank": True}, {}, "data_parallel_rank must be"),
        ("/generate", text | {"routed_dp_rank": 0, "data_parallel_rank": 1.5}, {}, "integer"),
        ("/v1/completions", prompt, {"X-Data-Parallel-Rank": "one"}, "Invalid X-Data-Parallel"),
        ("/v1/completions", prompt, {"x-data-parallel-rank": "2"}, "out of range"),
        ("/v1/completions", prompt, {"X-Data-Parallel-Rank": "-1"}, "out of range"),
        ("/v1/completions", prompt | {"routed_dp_rank": 9}, {}, "out of range"),
    ]
    for path, body, headers, message in cases:
        async with http.post(worker.url + path, json=body, headers=headers) as resp:
            assert resp.status == 400, (path, body, headers)
            error = (await resp.json())["error"]
            assert message in error["message"], (error, body, headers)
    # a bad header on /generate is not read at all
    async with http.post(
        worker.url + "/generate", json=text, headers={"X-Data-Parallel-Rank": "x"}
    ) as resp:
        assert resp.status == 200


async def test_server_info_advertises_the_dp_size(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    async with http.get(worker.url + "/server_info") as resp:
        info = await resp.json()
    assert info["dp_size"] == 2 and info["kv_events"]["dp_size"] == 2
    assert worker.kv_events.endpoints == [
        f"tcp://127.0.0.1:{info['kv_events']['endpoint_port_base'] + r}" for r in (0, 1)
    ]
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
