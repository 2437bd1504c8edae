"""The HTTP API as clients use it: the openai package, SSE streams, info endpoints, latency."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from indexer.protocol import ByteTokenizer, render_chat
from workers.cache import Namespace as CacheNamespace
from workers.config import WorkerConfig
from workers.io_struct import Generation
from workers.scheduler import Job
from workers.worker import ReferenceWorker

PAGE = 4


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    config = WorkerConfig(page_size=PAGE, capacity_tokens=4096, time_scale=0, model="ref-model")
    async with ReferenceWorker(config) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a careful assistant with a long system prompt."},
    {"role": "user", "content": "What is a radix tree?"},
]


async def test_chat_input_ids_are_the_prompt_as_in_sglang(worker: ReferenceWorker) -> None:
    ids = list(range(40, 40 + 3 * PAGE))
    async with openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused") as client:
        for cached in (0, 2 * PAGE):
            done = await client.chat.completions.create(
                model="ref-model", messages=MESSAGES, max_tokens=1, extra_body={"input_ids": ids}
            )
            assert done.usage is not None and done.usage.prompt_tokens == len(ids)
            assert done.usage.prompt_tokens_details is not None
            assert done.usage.prompt_tokens_details.cached_tokens == cached


async def test_openai_chat_with_and_without_streaming(worker: ReferenceWorker) -> None:
    async with openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused") as client:
        first = await client.chat.completions.create(
            model="ref-model",
            messages=MESSAGES,
            max_tokens=5,
            extra_body={"cache_salt": "t1"},
        )
        prompt_ids = ByteTokenizer().encode(render_chat(MESSAGES), add_bos=True)
        assert first.choices[0].message.content
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None
        assert first.usage.prompt_tokens == len(prompt_ids)
        assert first.usage.completion_tokens == 5
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0

        stream = await client.chat.completions.create(
            model="ref-model",
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "t1"},
        )
        pieces: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == first.choices[0].message.content
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // PAGE * PAGE

        models = await client.models.list()
        assert [m.id for m in models.data] == ["ref-model"]


async def test_openai_completions_with_token_prompt(worker: ReferenceWorker) -> None:
    async with openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused") as client:
        ids = list(range(10, 40))
        for expected_cached in (0, 28):
            out = await client.completions.create(model="ref-model", prompt=ids, max_tokens=3)
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            assert out.usage.prompt_tokens_details.cached_tokens == expected_cached
            assert len(out.choices[0].text) == 3


async def test_a_batch_of_completion_prompts_runs_each_in_its_namespace(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """`prompt` as a list of strings, or of token id lists: one choice per item (`index` its
    place), usage summed over the items, each cached in its own namespace (`cache_salt` one
    value or one per item), as SGLang runs a batched completion. It was a 400 here ("prompt
    must be a string or a list of token ids"), so `kvroute up` refused what SGLang takes."""
    texts = ["the first prompt of a batch, long enough", "and a second one, also long enough"]
    body = {"prompt": texts, "max_tokens": 3, "cache_salt": ["a", "b"]}
    for cached in (0, 1):
        async with http.post(f"{worker.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(len(c["text"]) == 3 for c in answer["choices"])
        usage = answer["usage"]
        assert usage["completion_tokens"] == 6
        prompt_tokens = [len(ByteTokenizer().encode(t)) for t in texts]
        assert usage["prompt_tokens"] == sum(prompt_tokens)
        reused = sum((n - 1) // PAGE * PAGE for n in prompt_tokens)
        assert usage["prompt_tokens_details"]["cached_tokens"] == reused * cached
    # one rid for the batch names each item `rid_i`, as SGLang (every item had the same one)
    async with http.post(f"{worker.url}/v1/completions", json={**body, "rid": "same"}) as resp:
        assert (await resp.json())["id"] == "cmpl-same_0"
    generate = {"text": texts, "rid": "same", "sampling_params": {"max_new_tokens": 1}}
    async with http.post(f"{worker.url}/generate", json=generate) as resp:
        assert [item["meta_info"]["id"] for item in await resp.json()] == ["same_0", "same_1"]
    # each item in its own namespace: "a" holds the first prompt, not the second
    a_ids = ByteTokenizer().encode(texts[0])
    assert worker.match(CacheNamespace(cache_salt="a"), a_ids)[0] > 0
    assert worker.match(CacheNamespace(cache_salt="b"), a_ids)[0] == 0
    # token id lists, streamed: every item's chunks name it, the usage is the batch's
    ids = [list(range(100, 130)), list(range(200, 230))]
    streamed = {"prompt": ids, "max_tokens": 2, "stream": True}
    streamed["stream_options"] = {"include_usage": True}
    async with http.post(f"{worker.url}/v1/completions", json=streamed) as resp:
        events = await _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks}
    assert ends == {0: "length", 1: "length"}
    texts_by_item = [[c for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)]
    assert [len(item) for item in texts_by_item] == [3, 3]  # two tokens and the end, each
    (usage,) = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (60, 4)
    # refused as SGLang's types refuse them: mixed kinds, a salt list of another length
    for bad, said in (
        ({"prompt": ["text", [1, 2]]}, "prompt[1]: a batch of prompts is all strings or all"),
        ({"prompt": texts, "cache_salt": ["a"]}, "cache_salt has 1 values for a batch of 2"),
    ):
        async with http.post(f"{worker.url}/v1/completions", json=bad) as resp:
            assert resp.status == 400
            assert said in (await resp.json())["error"]["message"]


async def test_a_list_of_one_prompt_is_a_batch_of_one_that_takes_a_list_of_one_salt(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """SGLang 0.5.23 reads `prompt: [[ids]]` (or `["text"]`) as a batch of one, whose
    `cache_salt` may be a list of one. Here it was read as the one prompt, and the salt list
    refused with a 400 (QA: a request the router routes)."""
    ids = list(range(100, 140))
    for prompt in ([ids], [ByteTokenizer().decode(ids)]):
        body = {"prompt": prompt, "max_tokens": 2, "cache_salt": ["tenant-a"]}
        for cached in (0, 1):
            async with http.post(f"{worker.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            assert [c["index"] for c in answer["choices"]] == [0]
            details = answer["usage"]["prompt_tokens_details"]
            reusable = (answer["usage"]["prompt_tokens"] - 1) // PAGE * PAGE
            assert details["cached_tokens"] == cached * reusable
        # in that salt's namespace, not the unsalted one
        assert worker.match(CacheNamespace(cache_salt="tenant-a"), ids)[0] > 0
        assert worker.match(CacheNamespace(), ids)[0] == 0
        worker.flush_all()


async def _sse(resp: aiohttp.ClientResponse) -> list[object]:
    events: list[object] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_generate_stream_reports_cumulative_text_and_meta(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    body = {
        "input_ids": list(range(5, 25)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 4},
    }
    async with http.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert len(chunks) == 4
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert chunks[-1]["meta_info"]["prompt_tokens"] == 20
    assert chunks[0]["meta_info"]["finish_reason"] is None


async def test_completions_stream_with_usage(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    body = {
        "prompt": "hello world, how are you",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": "x",
    }
    async with http.post(f"{worker.url}/v1/completions", json=body) as resp:
        events = await _sse(resp)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[0]["completion_tokens"] == 3
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_info_endpoints(worker: ReferenceWorker, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{worker.url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{worker.url}/get_model_info") as resp:
        assert (await resp.json())["model_path"] == "ref-model"
    for path in ("/server_info", "/get_server_info"):
        async with http.get(f"{worker.url}{path}") as resp:
            info = await resp.json()
        kv = info["kv_events"]
        # SGLang 0.5.23's block (`describe_kv_events_publisher`), its keys in its order: it
        # was the reference workers' own (endpoint, replay_endpoint, replay_port_base,
        # event_format, endpoints, replay_endpoints), so no router met SGLang's shape here
        assert list(kv) == [
            "publisher",
            "endpoint_host",
            "endpoint_port_base",
            "topic",
            "block_size",
            "dp_size",
            "replay_endpoint_port_base",
        ]
        assert (kv["publisher"], kv["endpoint_host"]) == ("zmq", "127.0.0.1")
        assert worker.kv_events.endpoint == f"tcp://127.0.0.1:{kv['endpoint_port_base']}"
        replay = f"tcp://127.0.0.1:{kv['replay_endpoint_port_base']}"
        assert worker.kv_events.replay_endpoint == replay
        assert (kv["block_size"], kv["dp_size"], kv["topic"]) == (PAGE, 1, "")


async def test_flush_one_salt_keeps_the_others(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    text = "flush only one namespace please"
    for salt in ("keep", "drop"):
        body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}}
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            assert resp.status == 200
    async with http.post(f"{worker.url}/flush_cache", json={"cache_salt": "drop"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["pages_removed"] > 0
    for salt, cached in (("keep", True), ("drop", False)):
        async with http.post(
            f"{worker.url}/debug/match", json={"text": text, "cache_salt": salt}
        ) as resp:
            assert ((await resp.json())["cached_tokens"] > 0) is cached
    async with http.post(f"{worker.url}/flush_cache", json={"cache_salt": 3}) as resp:
        assert resp.status == 400
        assert "cache_salt" in (await resp.json())["error"]["message"]
    # a whole flush says what it removed too (it said 0)
    async with http.post(f"{worker.url}/flush_cache") as resp:
        assert resp.status == 200
        assert (await resp.json())["pages_removed"] > 0
    async with http.post(f"{worker.url}/flush_cache") as resp:
        assert (await resp.json())["pages_removed"] == 0  # nothing left


async def test_a_get_flushes_everything_as_sglangs(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """SGLang 0.5.23 routes GET /flush_cache as POST (it answered 405 here); a GET reads no
    body there, so whatever it carries it flushes every namespace."""
    for salt in ("a", "b"):
        body = {"text": "flushed by a GET", "cache_salt": salt}
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            assert resp.status == 200
    async with http.get(f"{worker.url}/flush_cache", json={"cache_salt": "a"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["pages_removed"] > 0
    for salt in ("a", "b"):
        probe = {"text": "flushed by a GET", "cache_salt": salt}
        async with http.post(f"{worker.url}/debug/match", json=probe) as resp:
            assert (await resp.json())["cached_tokens"] == 0


async def test_bad_bodies_are_400(worker: ReferenceWorker, http: aiohttp.ClientSession) -> None:
    cases = [
        ("/generate", b"{not json"),
        ("/generate", b"[1, 2]"),
        ("/generate", b'{"text": "a", "input_ids": [1]}'),
        ("/generate", b'{"input_ids": [1, -2]}'),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": "x"}}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "cache_salt": 1}'),
        ("/v1/completions", b'{"prompt": 5}'),
        ("/generate", b'{"text": "a", "data_parallel_rank": 3}'),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 100000}}'),
    ]
    for path, raw in cases:
        async with http.post(f"{worker.url}{path}", data=raw) as resp:
            assert resp.status == 400, (path, raw)
            assert (await resp.json())["error"]["message"]


async def test_a_cache_hit_shortens_time_to_first_token() -> None:
    config = WorkerConfig(
        page_size=PAGE, capacity_tokens=8192, prefill_ms_per_token=0.5, decode_ms_per_token=0
    )
    async with ReferenceWorker(config) as worker, aiohttp.ClientSession() as http:
        body = {"input_ids": [7] * 400, "sampling_params": {"max_new_tokens": 1}}
        latencies = []
        for _ in range(2):
            async with http.post(f"{worker.url}/generate", json=body) as resp:
                latencies.append((await resp.json())["meta_info"]["e2e_latency"])
    assert latencies[0] >= 0.2  # 400 uncached tokens at 0.5 ms
    assert latencies[1] < 0.2  # 4 uncached tokens


async def test_running_batch_is_bounded_and_queue_drains() -> None:
    config = WorkerConfig(page_size=PAGE, max_running_requests=2, decode_ms_per_token=5)
    async with ReferenceWorker(config) as worker:
        from workers.io_struct import parse_generate

        jobs = [
            worker.submit(
                parse_generate(
                    {"input_ids": [i + 3] * 8, "sampling_params": {"max_new_tokens": 4}}
                ).items[0]
            )
            for i in range(5)
        ]
        sched = worker.ranks[0]
        for _ in range(1000):
            if sched.load[0] == 2:
                break
            await asyncio.sleep(0.001)
        assert sched.load == (2, 3)
        outputs = await asyncio.gather(*(job.wait() for job in jobs))
        assert all(len(o) == 4 for o in outputs)
        assert sched.idle and sched.completed == 5
        stats = sched.cache.stats()
        assert stats.reserved_pages == 0 and stats.protected_pages == 0


async def test_pool_pressure_evicts_and_never_overflows(http: aiohttp.ClientSession) -> None:
    config = WorkerConfig(page_size=PAGE, capacity_tokens=64, time_scale=0)
    async with ReferenceWorker(config) as worker:
        for i in range(12):
            body = {"input_ids": [i + 10] * 20, "sampling_params": {"max_new_tokens": 2}}
            async with http.post(f"{worker.url}/generate", json=body) as resp:
                assert resp.status == 200
            stats = worker.ranks[0].cache.stats()
            assert stats.tree_pages + stats.reserved_pages <= stats.total_pages
        async with http.post(f"{worker.url}/debug/match", json={"input_ids": [10] * 20}) as resp:
            assert (await resp.json())["cached_tokens"] == 0  # evicted long ago
        async with http.post(f"{worker.url}/debug/match", json={"tokens": [21] * 20}) as resp:
            assert (await resp.json())["held_tokens"] == 20


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/generate",
            {"text": "a long answer nobody reads", "sampling_params": {"max_new_tokens": 5000}},
        ),
        ("/v1/completions", {"prompt": "a long answer nobody reads", "max_tokens": 5000}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "nobody reads"}], "max_tokens": 5000},
        ),
    ],
)
async def test_a_client_that_goes_away_frees_its_pages(
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: dict[str, object],
) -> None:
    config = WorkerConfig(page_size=PAGE, decode_ms_per_token=2)
    async with ReferenceWorker(config) as worker:
        sched = worker.ranks[0]
        async with http.post(f"{worker.url}{path}", json=body | {"stream": True}) as resp:
            await resp.content.readline()  # the first chunk arrived: the request is running
            assert sched.load == (1, 0)
        # The server notices on its next write; the full answer would take 10 s, so only an
        # early stop makes the worker idle within the deadline.
        async with asyncio.timeout(5):
            while True:  # no event to wait on: poll the state, under a deadline
                if sched.idle:
                    break
                await asyncio.sleep(0.002)
        stats = sched.cache.stats()
        assert (stats.reserved_pages, stats.protected_pages) == (0, 0)
        # what it cached (prompt + output so far) shows it stopped long before 5000 tokens
        assert stats.tree_pages * PAGE < 1000
    # a disconnect is routine, not an error (here it arrives as the handler's cancellation;
    # the write that meets the closed socket first is the next test's)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "gone mid-write", "sampling_params": {"max_new_tokens": 5000}}),
        ("/v1/completions", {"prompt": "gone mid-write", "max_tokens": 5000}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "gone mid-write"}], "max_tokens": 5000},
        ),
    ],
)
async def test_a_write_that_meets_a_closed_socket_ends_the_stream_quietly(
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, object],
) -> None:
    import workers.server

    # Under load a write can meet the client's closed socket before aiohttp cancels the
    # handler (the soak logged a traceback per such disconnect). Real sockets cannot order
    # that race on demand, so the stream's own write raises what aiohttp raises then, once,
    # when armed; the client stays connected, so no cancellation can stop the job instead.
    armed = asyncio.Event()
    raised: list[web.StreamResponse] = []
    open_sse = workers.server._open_sse

    async def open_sse_that_loses_its_client(request: web.Request) -> web.StreamResponse:
        response = await open_sse(request)
        write = response.write

        async def write_to_a_closed_socket(data: bytes) -> None:
            if armed.is_set() and not raised:
                raised.append(response)
                raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
            await write(data)

        monkeypatch.setattr(response, "write", write_to_a_closed_socket)
        return response

    monkeypatch.setattr(workers.server, "_open_sse", open_sse_that_loses_its_client)
    config = WorkerConfig(page_size=PAGE, decode_ms_per_token=2)
    async with ReferenceWorker(config) as worker:
        sched = worker.ranks[0]
        jobs: list[Job] = []
        submit = worker.submit

        def submit_and_keep(generation: Generation) -> Job:
            jobs.append(submit(generation))
            return jobs[-1]

        monkeypatch.setattr(worker, "submit", submit_and_keep)
        async with http.post(f"{worker.url}{path}", json=body | {"stream": True}) as resp:
            await resp.content.readline()  # the first chunk arrived: the request is running
            assert sched.load == (1, 0)
            armed.set()
            async with asyncio.timeout(5):  # the full answer would take 10 s
                while True:  # no event to wait on: poll the state, under a deadline
                    if sched.idle:
                        break
                    await asyncio.sleep(0.002)
            assert len(raised) == 1
            assert [job.cancelled for job in jobs] == [True]
            stats = sched.cache.stats()
            assert (stats.reserved_pages, stats.protected_pages) == (0, 0)
            assert stats.tree_pages * PAGE < 1000  # stopped long before 5000 tokens
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_the_waiting_queue_is_bounded() -> None:
    from workers.io_struct import parse_generate
    from workers.scheduler import QueueFullError

    config = WorkerConfig(
        page_size=PAGE, max_running_requests=1, max_queued_requests=1, time_scale=0
    )
    async with ReferenceWorker(config) as worker:
        item = parse_generate(
            {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
        ).items[0]
        job = worker.submit(item)
        with pytest.raises(QueueFullError):
            worker.submit(item)
        assert await job.wait()


async def test_flush_naming_the_unsalted_namespace_keeps_the_salted_ones(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    text = "an empty salt names the unsalted namespace, not every namespace"
    for salt in ("", "tenant"):
        body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}}
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            assert resp.status == 200
    async with http.post(f"{worker.url}/flush_cache", json={"cache_salt": ""}) as resp:
        assert resp.status == 200
        assert (await resp.json())["pages_removed"] > 0
    for salt, cached in (("", False), ("tenant", True)):
        async with http.post(
            f"{worker.url}/debug/match", json={"text": text, "cache_salt": salt}
        ) as resp:
            assert ((await resp.json())["cached_tokens"] > 0) is cached


async def test_a_crashed_scheduler_fails_requests_instead_of_hanging(
    worker: ReferenceWorker,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("injected fault")

    # A bug inside a scheduler step cannot be produced for real: inject one.
    monkeypatch.setattr(worker.ranks[0].cache, "insert", broken)
    salt = "secret-salt-1"
    body = {"text": "never served", "cache_salt": salt, "sampling_params": {"max_new_tokens": 3}}
    async with asyncio.timeout(10):
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            assert resp.status == 500
            answer = await resp.text()
        assert json.loads(answer)["error"]["type"] == "worker_error"
        assert salt not in answer
        async with http.get(f"{worker.url}/health") as resp:
            assert resp.status == 500
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            assert resp.status == 500  # refused at once: nobody would run it
    assert "crashed" in caplog.text and salt not in caplog.text
    assert worker.ranks[0].idle


async def test_an_adapters_pages_are_its_own(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """`lora_path` (and the OpenAI routes' `base:adapter`) put a request's pages in the
    adapter's namespace, as SGLang's radix cache does: the base model reuses none of them."""
    ids = list(range(40, 40 + 6 * PAGE))

    async def generate(**extra: object) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **extra}
        async with http.post(worker.url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["meta_info"]["cached_tokens"])

    assert await generate(lora_path="sql") == 0
    assert await generate(lora_path="sql") == 5 * PAGE
    assert await generate() == 0  # the base model: none of the adapter's pages
    assert await generate(lora_path="chat") == 0
    prompt = "an adapter named in the model, as SGLang's OpenAI routes read it " * 2
    async with openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused") as client:
        for model, cached in (
            ("ref-model:sql", False),
            ("ref-model:sql", True),
            ("ref-model", False),
        ):
            done = await client.completions.create(model=model, prompt=prompt, max_tokens=1)
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            hit = (done.usage.prompt_tokens_details.cached_tokens or 0) > 0
            assert hit is cached, model


async def test_prompt_logprobs_start_at_logprob_start_len_as_sglangs(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """SGLang 0.5.23 reports `input_token_logprobs` for the prompt from `logprob_start_len` on
    (the first without a value), none when it is unset (-1 scores the output only), and aborts
    a start beyond the prompt with a 400; they started at token 0 whatever it said, and a start
    past the prompt was served."""
    prompt = list(range(20, 33))  # 13 tokens

    async def logprobs(**fields: object) -> tuple[int, object]:
        body = {"input_ids": prompt, "return_logprob": True, **fields}
        body["sampling_params"] = {"max_new_tokens": 1}
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                return resp.status, answer["error"]["message"]
            return resp.status, answer["meta_info"]["input_token_logprobs"]

    status, scored = await logprobs(logprob_start_len=5)
    assert status == 200 and isinstance(scored, list)
    assert [t for _, t, _ in scored] == prompt[5:]
    assert scored[0][0] is None and all(isinstance(v, float) for v, _, _ in scored[1:])
    status, whole = await logprobs(logprob_start_len=0)
    assert status == 200 and isinstance(whole, list)
    assert [t for _, t, _ in whole] == prompt and whole[0][0] is None
    assert whole[6:] == scored[1:]  # the same values where both score
    assert await logprobs() == (200, [])  # unset: the output's only
    assert await logprobs(logprob_start_len=-1) == (200, [])
    assert await logprobs(logprob_start_len=13) == (200, [])  # the whole prompt is allowed
    status, message = await logprobs(logprob_start_len=50)
    assert status == 400 and "logprob_start_len=50 is higher than" in str(message)
    # without return_logprob SGLang ignores it: served
    body = {"input_ids": prompt, "logprob_start_len": 50, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.status == 200


async def test_debug_match_says_what_the_request_would_report_as_cached(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """/debug/match's `cached_tokens` is the hit the same request then reports: its prompt but
    the last token, page aligned, capped by `logprob_start_len` (it said 16 of a cached
    page-aligned 16-token prompt, of which a request reuses 12, and 16 with a start of 0); the
    whole prompt's cached prefix is `held_tokens`."""
    prompt = list(range(10, 10 + 4 * PAGE))  # page aligned
    first = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(f"{worker.url}/generate", json=first) as resp:
        assert resp.status == 200
    for fields in (
        {},
        {"return_logprob": True, "logprob_start_len": 0},
        {"return_logprob": True, "logprob_start_len": 2 * PAGE + 1},
    ):
        body = {**first, **fields}
        async with http.post(f"{worker.url}/debug/match", json=body) as resp:
            match = await resp.json()
        async with http.post(f"{worker.url}/generate", json=body) as resp:
            reported = (await resp.json())["meta_info"]["cached_tokens"]
        assert match["cached_tokens"] == match["ranks"][0] == reported, fields
        assert match["held_tokens"] == match["held_ranks"][0] == 4 * PAGE
    assert reported == 2 * PAGE


async def test_streamed_chat_sends_its_role_chunk_with_the_first_token() -> None:
    """SGLang's serving_chat sends the role chunk once the first output exists, so a router
    takes a stream's first chunk as its first token. Before, the reference worker sent it at
    once, before the prefill (3 ms against a 300 ms prefill here)."""
    cfg = WorkerConfig(prefill_ms_per_token=1.0, decode_ms_per_token=5.0, time_scale=1.0)
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": "a" * 300}],
        "max_tokens": 3,
        "stream": True,
    }
    async with ReferenceWorker(cfg) as worker, aiohttp.ClientSession() as session:
        started = asyncio.get_running_loop().time()
        async with session.post(worker.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            waited = asyncio.get_running_loop().time() - started
            rest = await resp.read()
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert waited >= 0.25  # the prompt's prefill (300 tokens at 1 ms) came first
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events)
