"""The engine specs: every engine name has one, and each owns the rules that differ."""

from __future__ import annotations

from typing import get_args

import pytest

from indexer.engines import (
    ENGINES,
    SGLANG,
    VLLM,
    VLLM_PREFILL_KV_TRANSFER_PARAMS,
    EngineName,
    NamespaceRule,
    PdPairing,
    engine_spec,
)
from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.events import EventBatch, Stored


def test_every_engine_name_has_exactly_one_spec() -> None:
    assert sorted(ENGINES) == sorted(get_args(EngineName))
    assert all(engine_spec(name).name == name for name in ENGINES)
    with pytest.raises(ValueError, match="unknown engine 'trtllm'"):
        engine_spec("trtllm")


def test_the_specs_say_where_the_namespace_lives() -> None:
    assert SGLANG.namespace_rule is NamespaceRule.PER_EVENT
    assert VLLM.namespace_rule is NamespaceRule.ROOT_EXTRA_KEYS
    # a child event without extra_keys inherits its parent's salt only under vLLM's rule
    for spec, inherited in ((SGLANG, False), (VLLM, True)):
        index = PrefixIndex()
        index.add_stream("s", engine=spec.name, block_size=2)
        root = Stored(
            block_hashes=[1], parent=None, token_ids=[1, 2], block_size=2, extra_keys=[["t"]]
        )
        child = Stored(block_hashes=[2], parent=1, token_ids=[3, 4], block_size=2)
        index.apply("s", EventBatch(ts=0.0, events=[root, child]))
        held = {n.namespace: n.blocks for n in index.namespaces()}
        assert held.get(Namespace("", None, "t")) == (2 if inherited else 1), spec.name


def test_discovery_and_dp_rank_rules_follow_the_engines_code() -> None:
    # sglang/srt/disaggregation/kv_events.py KVEventsConfig (0.5.23): unnamed, the publisher
    # is the null one (nothing published)
    config = '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'
    info: dict[str, object] = {"kv_events_config": config, "page_size": 16, "dp_size": 2}
    assert SGLANG.advertised_events(info) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "block_size": 16,
        "dp_size": 2,
    }
    info["kv_events_config"] = '{"endpoint": "tcp://*:5557"}'
    assert SGLANG.advertised_events(info)["publisher"] == "null"
    # sglang/srt/runtime_context.py describe_kv_events_publisher (0.5.23): the descriptor
    # /server_info carries as `kv_events`, preferred to the config it was made from
    info["kv_events"] = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 32,
        "dp_size": 2,
        "replay_endpoint_port_base": 6557,
    }
    advertised = SGLANG.advertised_events(info)
    assert (advertised["endpoint"], advertised["replay_endpoint"]) == (
        "tcp://*:5557",
        "tcp://*:6557",
    )
    assert advertised["block_size"] == 32
    assert SGLANG.server_info_paths == ("/server_info", "/get_server_info")
    assert VLLM.server_info_paths == () and VLLM.advertised_events(info) == {}
    # sglang/srt/managers/io_struct.py and entrypoints/openai/serving_base.py (0.5.23)
    assert (SGLANG.dp_rank_generate_field, SGLANG.dp_rank_header.lower()) == (
        "routed_dp_rank",
        "x-data-parallel-rank",
    )
    assert VLLM.dp_rank_header == "X-data-parallel-rank" and VLLM.dp_rank_generate_field is None


def test_prefill_decode_rules_follow_each_engine() -> None:
    # SGLang 0.5.23 dumps its server args into /server_info: "null" is a worker doing both
    assert SGLANG.pd_pairing is PdPairing.BOOTSTRAP_ROOM
    assert SGLANG.advertised_role(
        {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9001}
    ) == ("prefill", 9001)
    assert SGLANG.advertised_role({"disaggregation_mode": "null"}) == ("both", None)
    assert SGLANG.advertised_role({"disaggregation_mode": "decode"})[0] == "decode"
    assert SGLANG.advertised_role({"disaggregation_bootstrap_port": True}) == (None, None)
    assert SGLANG.default_bootstrap_port == 8998
    # vLLM's kv_role is not advertised; its proxy protocol goes through kv_transfer_params
    assert VLLM.pd_pairing is PdPairing.KV_TRANSFER_PARAMS
    assert VLLM.advertised_role({"disaggregation_mode": "prefill"}) == (None, None)
    assert VLLM_PREFILL_KV_TRANSFER_PARAMS["do_remote_decode"] is True
