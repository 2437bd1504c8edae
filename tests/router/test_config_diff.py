"""What a reload changes (`router.config_diff`): live keys, keys kept for a restart, workers."""

from __future__ import annotations

import msgspec

from router.config import (
    ClusterConfig,
    IndexerSection,
    LimitsConfig,
    ListenConfig,
    PolicyConfig,
    RouterConfig,
    TracingConfig,
    WorkerConfig,
)
from router.config_diff import diff_configs


def _workers(*ids_urls: tuple[str, str]) -> tuple[WorkerConfig, ...]:
    return tuple(WorkerConfig(id=i, url=u) for i, u in ids_urls)


def test_the_same_file_changes_nothing() -> None:
    config = RouterConfig(workers=_workers(("a", "http://a:1")))
    running, diff = diff_configs(config, msgspec.convert(msgspec.to_builtins(config), RouterConfig))
    assert diff.empty and diff.summary() == "nothing changed"
    assert running == config


def test_workers_are_diffed_by_id() -> None:
    old = RouterConfig(workers=_workers(("a", "http://a:1"), ("b", "http://b:1")))
    new = RouterConfig(workers=_workers(("a", "http://a:2"), ("c", "http://c:1")))
    running, diff = diff_configs(old, new)
    assert (diff.workers_added, diff.workers_removed, diff.workers_changed) == (["c"], ["b"], ["a"])
    assert running.workers == new.workers


def test_live_keys_change_and_restart_keys_keep_their_running_value() -> None:
    old = RouterConfig()
    new = RouterConfig(
        listen=ListenConfig(port=9000),
        policy=PolicyConfig(name="round_robin", hit_weight=1.0, approx_max_tree_size=8),
        limits=LimitsConfig(
            max_retries=0, max_adapter_name_bytes=64, max_body_bytes=4096, idle_timeout_s=5.0
        ),
        indexer=IndexerSection(pending_ttl_s=9.0),
        tracing=TracingConfig(enabled=True),
        cluster=ClusterConfig(),
        salt_header="x-tenant",
    )
    running, diff = diff_configs(old, new)
    assert diff.changed == [
        "policy.hit_weight",
        "limits.max_retries",
        "limits.max_adapter_name_bytes",  # read per request, as max_salt_bytes
        "salt_header",
    ]
    assert diff.needs_restart == [
        "listen.port",
        "policy.name",
        "policy.approx_max_tree_size",
        "limits.max_body_bytes",
        "limits.idle_timeout_s",
        "indexer.pending_ttl_s",
        "tracing.enabled",
        "cluster",
    ]
    assert running.policy == PolicyConfig(hit_weight=1.0)
    assert running.limits == LimitsConfig(max_retries=0, max_adapter_name_bytes=64)
    assert (running.listen, running.indexer, running.tracing) == (
        old.listen,
        old.indexer,
        old.tracing,
    )
    assert running.cluster is None and running.salt_header == "x-tenant"
    assert "needs restart (kept): listen.port" in diff.summary()


def test_a_section_not_in_the_live_table_needs_a_restart() -> None:
    # a section added to RouterConfig later is reported, never silently ignored
    old = RouterConfig(fleet=None)
    new = RouterConfig(fleet={"workers": 2})
    running, diff = diff_configs(old, new)
    assert diff.needs_restart == ["fleet"] and running.fleet is None
