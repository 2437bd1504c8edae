"""Event-stream discovery: worker config completed from /server_info, both advertised shapes."""

from __future__ import annotations

import json

import pytest

from router.config import WorkerConfig
from router.errors import RequestError
from router.fleet.advertised import replay_proof
from router.fleet.discovery import needs_discovery, streams_for


def test_a_fully_configured_worker_needs_no_discovery() -> None:
    worker = WorkerConfig(
        url="http://10.0.0.1:30000",
        events="tcp://10.0.0.1:5557",
        replay="tcp://10.0.0.1:5600",
        block_size=16,
        dp_size=2,
        topic="kv",
        engine="vllm",
        model="llama",
    )
    assert not needs_discovery(worker)
    streams = streams_for(worker, None)
    assert [(s.endpoint, s.replay_endpoint, s.dp_rank) for s in streams] == [
        ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600", 0),
        ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601", 1),
    ]
    assert {(s.topic, s.block_size, s.engine, s.model) for s in streams} == {
        ("kv", 16, "vllm", "llama")
    }


def test_the_reference_workers_kv_events_block() -> None:
    info = {
        "page_size": 16,
        "kv_events": {
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:41000",
            "endpoint_port_base": 41000,
            "replay_endpoint": "tcp://127.0.0.1:42000",
            "replay_port_base": 42000,
            "topic": "",
            "block_size": 16,
            "dp_size": 2,
            "endpoints": ["tcp://127.0.0.1:41000", "tcp://127.0.0.1:41001"],
            "replay_endpoints": ["tcp://127.0.0.1:42000", "tcp://127.0.0.1:42001"],
        },
    }
    worker = WorkerConfig(url="http://127.0.0.1:30000")
    assert needs_discovery(worker)
    streams = streams_for(worker, info)
    assert [(s.endpoint, s.replay_endpoint) for s in streams] == [
        ("tcp://127.0.0.1:41000", "tcp://127.0.0.1:42000"),
        ("tcp://127.0.0.1:41001", "tcp://127.0.0.1:42001"),
    ]
    assert streams[0].block_size == 16


def test_configured_sockets_carry_the_ones_the_worker_advertises() -> None:
    """A worker configured with events on another PUB (a typo, or a forwarder) and its own
    replay socket: its streams are not proven, and carry what the worker advertises for
    their rank, so that a stream whose two sockets disagree can say which is the suspect
    (`indexer.stream.disagreement`); streams whose sockets are the advertised ones carry them
    too."""
    info = {
        "kv_events": {
            "publisher": "zmq",  # SGLang 0.5.23's descriptor
            "endpoint_port_base": 41000,
            "replay_endpoint_port_base": 42000,
            "endpoint_host": "127.0.0.1",
            "dp_size": 2,
            "block_size": 16,
            "topic": "",
        }
    }
    worker = WorkerConfig(
        url="http://127.0.0.1:30000",
        events="tcp://127.0.0.1:51000",
        replay="tcp://127.0.0.1:42000",
        dp_size=2,
    )
    streams, note = replay_proof(worker, info, streams_for(worker, info))
    assert note is not None and "tcp://127.0.0.1:51000" in note
    assert [(s.replay_proven, s.advertised_endpoint, s.advertised_replay) for s in streams] == [
        (False, "tcp://127.0.0.1:41000", "tcp://127.0.0.1:42000"),
        (False, "tcp://127.0.0.1:41001", "tcp://127.0.0.1:42001"),
    ]
    right = WorkerConfig(url="http://127.0.0.1:30000")
    streams, note = replay_proof(right, info, streams_for(right, info))
    assert note is None
    assert [(s.replay_proven, s.advertised_endpoint) for s in streams] == [
        (True, "tcp://127.0.0.1:41000"),
        (True, "tcp://127.0.0.1:41001"),
    ]


def test_stock_sglang_kv_events_config_with_a_wildcard_bind() -> None:
    config = {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    info = {"kv_events_config": json.dumps(config), "page_size": 32, "dp_size": 2}
    streams = streams_for(WorkerConfig(url="http://gpu-7:30000"), info)
    assert [(s.endpoint, s.replay_endpoint) for s in streams] == [
        ("tcp://gpu-7:5557", "tcp://gpu-7:5558"),
        ("tcp://gpu-7:5558", "tcp://gpu-7:5559"),
    ]
    assert streams[0].topic == "kv-events" and streams[0].block_size == 32


def test_config_fields_win_over_advertised_ones() -> None:
    info = {"kv_events": {"endpoint": "tcp://127.0.0.1:1000", "block_size": 16, "topic": "a"}}
    worker = WorkerConfig(url="http://127.0.0.1:1", topic="b", block_size=64)
    (stream,) = streams_for(worker, info)
    assert (stream.topic, stream.block_size, stream.replay_endpoint) == ("b", 64, None)


def test_workers_without_events() -> None:
    assert streams_for(WorkerConfig(url="http://a:1", kv_events=False), None) == []
    with pytest.raises(RequestError, match="no KV-event endpoint"):
        streams_for(WorkerConfig(url="http://a:1"), {"model_path": "m"})
    with pytest.raises(RequestError, match="one per dp rank"):
        streams_for(WorkerConfig(url="http://a:1", events=["tcp://a:1"], dp_size=2), None)


@pytest.mark.parametrize(
    ("advertised", "said"),
    [
        ({"endpoint": [1], "block_size": 16}, "expected endpoint strings"),
        ({"endpoint": "tcp://h:5557", "replay_endpoint": [None]}, "expected endpoint strings"),
        ({"endpoint": "tcp://h:99999", "block_size": 16}, "the port must be 1-65535"),
        ({"endpoint": "udp://h:5557", "block_size": 16}, "expected tcp://HOST:PORT"),
        # a digit to str.isdigit that int() refuses: a ValueError, not a RequestError
        ({"endpoint": "tcp://h:\u00b2", "block_size": 16}, "the port must be 1-65535"),
        ({"endpoint": "tcp://h:" + "9" * 5000}, "the port must be 1-65535"),
        # ranks past port 65535: refused before the per-rank list is built
        ({"endpoint": "tcp://h:65000", "dp_size": 1000}, "run to port 65999, past 65535"),
        (
            {"endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:65535", "dp_size": 2},
            "run to port 65536, past 65535",
        ),
        ({"endpoint": "tcp://h:5557", "endpoint_port_base": 65535, "dp_size": 2}, "past 65535"),
        # one stream per rank: over 1024 refused before any is built (10**9 took the memory)
        ({"endpoint": "tcp://h:5557", "dp_size": 5000}, "advertises dp_size 5000, over 1024"),
        ({"endpoint": "tcp://h:5557", "dp_size": 10**6}, "advertises dp_size 1000000, over"),
        # every key of its pages is chained from the page size: 2**64 made each request a 500
        ({"endpoint": "tcp://h:5557", "block_size": 2**64}, "page size 18446744073709551616"),
        ({"endpoint": "tcp://h:5557", "block_size": 65537}, "page size 65537, over 65536"),
    ],
)
def test_what_a_worker_advertises_wrong_is_a_request_error(
    advertised: dict[str, object], said: str
) -> None:
    # a RequestError is retried on the health rounds and a 400 on POST /admin/workers; anything
    # else took the router's startup down, or logged a traceback every round
    worker = WorkerConfig(url="http://10.0.0.1:30000")
    with pytest.raises(RequestError, match=said):
        streams_for(worker, {"served_model_name": "m", "kv_events": advertised})


def test_the_largest_page_size_and_rank_count_advertised_are_taken() -> None:
    info = {"kv_events": {"endpoint": "tcp://h:64512", "dp_size": 1024, "block_size": 65536}}
    streams = streams_for(WorkerConfig(url="http://10.0.0.1:30000"), info)
    assert len(streams) == 1024 and streams[-1].endpoint == "tcp://h:65535"
    assert {s.block_size for s in streams} == {65536}


def test_an_advertised_sglang_page_size_past_the_bound_is_refused() -> None:
    """SGLang's `page_size` beside its `kv_events_config`: the same bound as a descriptor's."""
    config = {"publisher": "zmq", "endpoint": "tcp://*:5557"}
    info = {"kv_events_config": json.dumps(config), "page_size": 2**64, "dp_size": 1}
    with pytest.raises(RequestError, match="page size 18446744073709551616, over 65536"):
        streams_for(WorkerConfig(url="http://gpu-7:30000"), info)
    # a configured block size is the one taken (the advertised one is only warned of)
    (stream,) = streams_for(WorkerConfig(url="http://gpu-7:30000", block_size=16), info)
    assert stream.block_size == 16


def test_a_configured_dp_size_the_worker_contradicts_is_refused() -> None:
    """Configured 1 against an advertised 2: rank 1 would go unsubscribed while the engine
    places requests there, predicted from rank 0's pages (a false hit); refused instead."""
    info = {"kv_events": {"endpoint": "tcp://127.0.0.1:41000", "dp_size": 2, "block_size": 16}}
    with pytest.raises(RequestError, match="config says dp_size 1, the worker advertises 2"):
        streams_for(WorkerConfig(url="http://127.0.0.1:1", dp_size=1), info)
    # agreeing, or left to the worker: its ranks
    for dp_size in (2, None):
        streams = streams_for(WorkerConfig(url="http://127.0.0.1:1", dp_size=dp_size), info)
        assert [s.dp_rank for s in streams] == [0, 1]


def test_stock_sglang_defaults_fill_what_kv_events_config_leaves_out() -> None:
    """SGLang's `KVEventsConfig` (0.5.23): the publisher is "null" unless named, and a zmq
    publisher binds tcp://*:5557 unless told."""
    zmq_only = {"kv_events_config": json.dumps({"publisher": "zmq"}), "page_size": 16}
    (stream,) = streams_for(WorkerConfig(url="http://gpu-3:30000"), zmq_only)
    assert stream.endpoint == "tcp://gpu-3:5557" and stream.block_size == 16
    for config in ({"endpoint": "tcp://*:6000"}, {"publisher": "null"}, {}):
        info = {"kv_events_config": json.dumps(config)}
        with pytest.raises(RequestError, match="publishes no KV events"):
            streams_for(WorkerConfig(url="http://gpu-3:30000"), info)
    # a config that names its events is taken as it is
    configured = WorkerConfig(url="http://gpu-3:30000", events="tcp://gpu-3:7000")
    assert streams_for(configured, {"kv_events_config": "{}"})[0].endpoint == "tcp://gpu-3:7000"


def test_sglang_0523s_own_descriptor_is_discovered() -> None:
    """What SGLang 0.5.23 puts in /server_info as `kv_events` (runtime_context.py,
    describe_kv_events_publisher): a host, port bases per rank, the events' block size."""
    info = {
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": 5557,
            "topic": "kv",
            "block_size": 64,  # page_size x dcp_size
            "dp_size": 2,
            "replay_endpoint_port_base": 6557,
        },
        "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557"}),
        "page_size": 32,
        "dp_size": 2,
    }
    streams = streams_for(WorkerConfig(url="http://gpu-9:30000"), info)
    assert [(s.endpoint, s.replay_endpoint, s.dp_rank) for s in streams] == [
        ("tcp://gpu-9:5557", "tcp://gpu-9:6557", 0),
        ("tcp://gpu-9:5558", "tcp://gpu-9:6558", 1),
    ]
    assert {(s.block_size, s.topic) for s in streams} == {(64, "kv")}
    # a worker that publishes nothing says null there
    silent = {**info, "kv_events": None, "kv_events_config": json.dumps({"publisher": "null"})}
    with pytest.raises(RequestError, match="publishes no KV events"):
        streams_for(WorkerConfig(url="http://gpu-9:30000"), silent)


def test_a_host_tier_is_read_as_sglangs_hicache_sizes_it() -> None:
    from router.fleet.discovery import host_capacity_from_server_info

    info = {"enable_hierarchical_cache": True, "hicache_ratio": 2.0, "max_total_num_tokens": 1000}
    assert host_capacity_from_server_info(info) == 2000
    for off in (
        {**info, "enable_hierarchical_cache": False},
        {**info, "hicache_ratio": None},
        {**info, "hicache_ratio": True},
        {**info, "hicache_ratio": 0},
        {k: v for k, v in info.items() if k != "max_total_num_tokens"},
        None,
    ):
        assert host_capacity_from_server_info(off) is None


def test_only_an_sglang_worker_that_neither_overlaps_nor_chunks_caches_prompts_at_once() -> None:
    from router.fleet.discovery import caches_prompts_late

    at_once = {"disable_overlap_schedule": True, "chunked_prefill_size": -1}
    assert not caches_prompts_late("sglang", at_once)
    # a chunk budget no batch can fill: as large as the KV pool
    pool = {"disable_overlap_schedule": True, "max_total_num_tokens": 4096}
    assert not caches_prompts_late("sglang", {**pool, "chunked_prefill_size": 4096})
    # SGLang's default: the next batch is formed while a prefill runs
    assert caches_prompts_late("sglang", {**at_once, "disable_overlap_schedule": False})
    assert caches_prompts_late("sglang", {"max_total_num_tokens": 1000})
    # a prompt split over batches when it does not fit what is left of one's budget
    assert caches_prompts_late("sglang", {**pool, "chunked_prefill_size": 2048})
    assert caches_prompts_late("sglang", {**at_once, "chunked_prefill_size": 8192})
    # what is not said, or said in another type, is taken as late (fail closed)
    for unsaid in (
        {"disable_overlap_schedule": True},
        {**at_once, "disable_overlap_schedule": "true"},
        {**at_once, "chunked_prefill_size": True},
        {**at_once, "chunked_prefill_size": "-1"},
        None,
    ):
        assert caches_prompts_late("sglang", unsaid), unsaid
    # vLLM chunks its prefills (its budget, `max_num_batched_tokens`, is not advertised)
    assert caches_prompts_late("vllm", at_once)


async def test_the_reference_worker_says_if_it_caches_late_and_the_router_reads_it() -> None:
    import aiohttp

    from router.service import RouterService
    from tests.router.conftest import Fleet, router_config
    from workers.config import WorkerConfig as ReferenceConfig
    from workers.worker import ReferenceWorker

    for overlap in (False, True):
        async with ReferenceWorker(ReferenceConfig(time_scale=0.0, overlap_schedule=overlap)) as w0:
            config = router_config([("w0", w0.url)])
            async with RouterService(config) as router, aiohttp.ClientSession() as session:
                await Fleet(router, {"w0": w0}, session).warm()
                entry = router.planner.pool.find("w0")
                assert entry is not None and entry.caches_prompts_late is overlap
