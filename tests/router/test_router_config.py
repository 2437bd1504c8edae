"""Config: typed TOML, unknown keys rejected by name, shipped configs valid."""

from __future__ import annotations

import argparse
import os
import re
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer.config import IndexerConfig
from router.config import (
    MAX_CONFIG_BYTES,
    BreakerConfig,
    LimitsConfig,
    RouterConfig,
    TimeoutsConfig,
    WorkerConfig,
    load_config,
    parse_config,
    redact_url,
)
from router.errors import ConfigError
from router.routing.pool import WorkerPool
from router.service import RouterService
from tests.router.conftest import router_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("doc", "name"),
    [
        ({"polcy": {}}, "polcy"),
        ({"policy": {"decode_wieght": 1.0}}, "decode_wieght"),
        ({"workers": [{"url": "http://a:1", "evnets": "tcp://a:2"}]}, "evnets"),
        ({"policy": {"name": "fastest"}}, "policy.name"),
        ({"listen": {"port": 70000}}, "listen.port"),
    ],
)
def test_bad_keys_and_values_are_named(doc: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    message = str(info.value)
    assert name.split(".")[-1] in message or f"$.{name}" in message


def test_cross_field_checks() -> None:
    # one url twice, without ids: said as one url (it was "duplicate id 'http://a:1'")
    with pytest.raises(ConfigError, match=r"workers\[0\] and workers\[1\] are one url") as twice:
        parse_config({"workers": [{"url": "http://a:1"}, {"url": "http://a:1/"}]})
    assert twice.value.key == "workers[1].url", twice.value.key
    with pytest.raises(ConfigError, match="duplicate id 'x'"):
        parse_config(
            {"workers": [{"url": "http://a:1", "id": "x"}, {"url": "http://b:1", "id": "x"}]}
        )
    with pytest.raises(ConfigError, match=r"tokenizer\.path"):
        parse_config({"tokenizer": {"kind": "hf"}})
    with pytest.raises(ConfigError, match="http"):
        parse_config({"workers": [{"url": "a:1"}]})
    for url in ("http://[::1", "http://a:port", "http://"):  # unparseable: refused up front
        with pytest.raises(ConfigError, match=r"workers\.url"):
            parse_config({"workers": [{"url": url}]})
    # credentials in a url: refused (the router sends none, the url would show as the id, in
    # labels and logs), and the refusal does not echo them
    for url in ("http://user:s3cr3t@a:1", "http://user@a:1", "http://:s3cr3t@a:1",
                "http://u:s3/cr3t@a:1", "http://u:s3cr3t@[::1"):  # fmt: skip
        with pytest.raises(ConfigError, match="carries credentials") as refused:
            parse_config({"workers": [{"url": url}]})
        assert "s3" not in str(refused.value) and "***@" in str(refused.value)
    # an "@" in the path is no credentials
    at = parse_config({"workers": [{"url": "http://127.0.0.1:32622/sglang@v2"}]})
    assert at.workers[0].url == "http://127.0.0.1:32622/sglang@v2"
    # nor may the event sockets carry any (ZMQ sends none), and the refusal hides them
    for key in ("events", "replay"):
        worker = {"url": "http://a:1", "events": "tcp://a:5557", key: "tcp://bob:S3cr3t@a:5557"}
        with pytest.raises(ConfigError, match="carries credentials") as refused:
            parse_config({"workers": [worker]})
        assert "S3cr3t" not in str(refused.value) and "tcp://***@a:5557" in str(refused.value)
    # one server under two ids would be two candidates, each with half its load
    # a scheme is case-insensitive: taken, spelled one way
    assert parse_config({"workers": [{"url": "HTTPS://A:1/x"}]}).workers[0].url == "https://A:1/x"
    for same in ("http://a:1/", "http://A:1", "http://a:1", "HTTP://a:1"):
        with pytest.raises(ConfigError, match="'x' and 'y' are one server"):
            parse_config({"workers": [{"url": "http://a:1", "id": "x"}, {"url": same, "id": "y"}]})
    with pytest.raises(ConfigError, match="one server"):
        parse_config(
            {"workers": [{"url": "http://a", "id": "x"}, {"url": "http://a:80", "id": "y"}]}
        )
    parse_config({"workers": [{"url": "http://a:1", "id": "x"}, {"url": "http://a:2", "id": "y"}]})


def test_localhost_and_its_address_are_one_server() -> None:
    """`http://localhost:P/` beside `http://127.0.0.1:P` was taken (a reload answered 200 and
    the second was `duplicate` once registered) while the same spelling twice is refused: the
    spellings that say the same address are refused alike; other names are not resolved."""
    pairs = [
        ("http://127.0.0.1:7", "http://localhost:7/"),
        ("http://127.0.0.1:7", "HTTP://LOCALHOST.:7"),
        ("http://[::1]:7", "http://[0:0::1]:7"),
    ]
    for first, second in pairs:
        workers = [{"url": first, "id": "x"}, {"url": second, "id": "y"}]
        with pytest.raises(
            ConfigError, match=f"'x' and 'y' are one server \\({re.escape(first)} and"
        ):
            parse_config({"workers": workers})
    for first, second in [
        ("http://localhost:7", "http://[::1]:7"),
        ("http://127.0.0.2:7", "http://localhost:7"),
    ]:
        parse_config({"workers": [{"url": first, "id": "x"}, {"url": second, "id": "y"}]})


@pytest.mark.parametrize(
    ("workers", "key"),
    [
        ([{"url": "http://a:1", "id": "x"}, {"url": "http://a:2", "id": "x"}], "workers[1].id"),
        ([{"url": "http://a:1"}, {"url": "http://a:1/"}], "workers[1].url"),  # id: the url
        ([{"url": "http://a:1", "id": "x"}, {"url": "http://a:1", "id": "y"}], "workers[1].url"),
    ],
)
def test_a_worker_listed_twice_is_refused_naming_the_key(
    workers: list[dict[str, str]], key: str
) -> None:
    """A refused reload names the key (`ReloadError.key`); before, these two gave None."""
    with pytest.raises(ConfigError) as refused:
        parse_config({"workers": workers})
    assert refused.value.key == key, refused.value


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"policy": {"medium_weights": {"GPUU": 2.0}}}, "policy.medium_weights"),
        ({"policy": {"medium_weights": {"CPU": float("inf")}}}, "policy.medium_weights.CPU"),
        ({"policy": {"hit_weight": float("inf")}}, "policy.hit_weight"),
        ({"policy": {"decode_weight": float("inf")}}, "policy.decode_weight"),
        ({"listen": {"port": 9, "metrics_port": 9}}, "listen.metrics_port"),
        ({"tokenizer": {"kind": "hf"}}, "tokenizer.path"),
        ({"tokenizer": {"offload_min_bytes": 1}}, "tokenizer.offload_min_bytes"),
        ({"cluster": {"url": "http://n:4222"}}, "cluster.url"),
        ({"cluster": {"heartbeat_timeout_s": 0.5}}, "cluster.heartbeat_timeout_s"),
        ({"workers": [{"url": "http://a:1"}, {"url": "ftp://x"}]}, "workers[1].url"),
        ({"workers": [{"url": "http://u:p@a:1"}]}, "workers[0].url"),
        ({"workers": [{"url": "http://a:99999"}]}, "workers[0].url"),
        ({"workers": [{"url": "http://"}]}, "workers[0].url"),
        ({"workers": [{"url": "http://a:1", "events": "udp://a:2"}]}, "workers[0].events"),
        ({"workers": [{"url": "http://a:1", "replay": ["tcp://a:2", "x"]}]}, "workers[0].replay"),
        ({"workers": [{"url": "http://a:1", "models": [" "]}]}, "workers[0].models"),
        (
            {"workers": [{"url": "http://a:1", "role": "decode", "bootstrap_port": 9}]},
            "workers[0].bootstrap_port",
        ),
        # ids go out in the x-kvroute-worker header and into log lines as they are
        (
            {"workers": [{"url": "http://a:1"}, {"url": "http://b:1", "id": "w\nx"}]},
            "workers[1].id",
        ),
        ({"workers": [{"url": "http://a:1", "id": "w\x7f"}]}, "workers[0].id"),
        ({"workers": [{"url": "http://a:1", "id": "w\x9b"}]}, "workers[0].id"),
        ({"workers": [{"url": "http://a:1", "id": "w\u00e9"}]}, "workers[0].id"),
        ({"workers": [{"url": "http://a:1/\r\n", "id": "w"}]}, "workers[0].url"),
        ({"workers": [{"url": "http://\u00e9.example:1"}]}, "workers[0].url"),  # the id
        (
            {"workers": [{"url": "http://a:1", "events": "tcp://a:65500", "dp_size": 64}]},
            "workers[0].dp_size",
        ),
        (
            {"workers": [{"url": "http://a:1", "replay": "tcp://a:65535", "dp_size": 2}]},
            "workers[0].dp_size",
        ),
    ],
)
def test_a_tables_own_check_names_the_field(doc: dict[str, Any], key: str) -> None:
    """A refused reload's `key` named only the table (`policy`, `workers[2]`) when the table's
    `__post_init__` refused a field; the message's path names the field too now."""
    with pytest.raises(ConfigError) as refused:
        parse_config(doc)
    assert refused.value.key == key, refused.value
    assert str(refused.value).endswith(f" - at `$.{key}`"), refused.value


@pytest.mark.parametrize(
    ("worker", "key", "said"),
    [
        # msgpack-encoded into every namespace seed: 2**64 made each request a 500
        ({"block_size": 2**64}, "block_size", "<= 65536"),
        ({"block_size": 65537}, "block_size", "<= 65536"),
        # one stream, one port pair and one candidate per rank: 10**9 took the memory
        ({"dp_size": 10**9}, "dp_size", "<= 1024"),
        ({"dp_size": 1025}, "dp_size", "<= 1024"),
    ],
)
def test_a_page_size_and_a_rank_count_are_bounded(
    worker: dict[str, Any], key: str, said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"workers": [{"url": "http://a:1", **worker}]})
    assert refused.value.key == f"workers[0].{key}" and said in str(refused.value)
    with pytest.raises(msgspec.ValidationError, match=f"{said} - at `\\$.{key}`"):
        msgspec.convert({"url": "http://a:1", **worker}, WorkerConfig)  # POST /admin/workers


def test_the_largest_page_size_and_rank_count_are_taken() -> None:
    worker = WorkerConfig(
        url="http://a:1",
        events="tcp://a:5557",
        replay="tcp://a:6600",
        block_size=65536,
        dp_size=1024,
    )
    assert (worker.block_size, worker.dp_size) == (65536, 1024)
    WorkerConfig(url="http://a:1", events="tcp://a:64512", dp_size=1024)  # to port 65535


@pytest.mark.parametrize("worker_id", ["w0", "a b", "a/b", "~!@#$%^&*()_+{}|:<>?", "x" * 256])
def test_a_worker_id_is_any_printable_ascii(worker_id: str) -> None:
    assert WorkerConfig(url="http://a:1", id=worker_id).worker_id == worker_id
    # a url of another script is no id but may be the url, with an ASCII id
    assert WorkerConfig(url="http://\u00e9.example:1", id=worker_id).worker_id == worker_id


@pytest.mark.parametrize(
    ("worker", "key", "said"),
    [
        # 3,100 characters closed a replica's NATS connection for good (its fleet key past
        # nats-server's 4 KiB control line); 9,000 could be neither drained nor removed
        ({"id": "x" * 257}, "id", "is 257 characters long"),
        ({"id": "k" * 9000}, "id", "is 9000 characters long"),
        ({"url": "http://a:1/" + "p" * 250}, "url", "is 261 characters long"),
        # the x-kvroute-worker header drops a value's outer spaces: `a ` reached clients as `a`
        ({"id": "a "}, "id", "begins or ends with a space"),
        ({"id": " lead"}, "id", "begins or ends with a space"),
        ({"id": "   "}, "id", "is blank"),
        ({"url": "http://a:1/x "}, "url", "begins or ends with a space"),
    ],
)
def test_a_worker_id_is_bounded_and_has_no_outer_space(
    worker: dict[str, Any], key: str, said: str
) -> None:
    doc = {"workers": [{"url": "http://a:1", **worker}]}
    with pytest.raises(ConfigError) as refused:
        parse_config(doc)
    assert refused.value.key == f"workers[0].{key}" and said in str(refused.value)
    # the refused id is quoted clipped: a 9,000-character one would fill the line
    assert len(str(refused.value)) < 600, str(refused.value)
    with pytest.raises(msgspec.ValidationError, match=said):
        msgspec.convert(doc["workers"][0], WorkerConfig)  # POST /admin/workers


def test_a_tables_own_check_is_a_value_error_outside_a_config() -> None:
    """`POST /admin/workers` converts one worker: the same check, the same message."""
    with pytest.raises(ValueError, match=r"^workers\.url must start with http"):
        msgspec.convert({"url": "ftp://x"}, WorkerConfig)


@pytest.mark.parametrize(
    "name", ["X Salt: bad", "X-Salt:", "x-salt ", "Ünicode", "a\tb", "(x)", "x/y", '"q"']
)
def test_a_salt_header_that_is_no_header_name_is_refused_naming_it(name: str) -> None:
    """A name no request can carry: the gateway's salt override never applied, silently."""
    with pytest.raises(ConfigError, match="salt_header") as refused:
        parse_config({"salt_header": name})
    assert refused.value.key == "salt_header", refused.value


@pytest.mark.parametrize("name", ["", "X-Tenant-Salt", "x_salt", "a!#$%&'*+-.^_`|~9"])
def test_any_rfc_9110_token_is_a_salt_header(name: str) -> None:
    assert parse_config({"salt_header": name}).salt_header == name


@pytest.mark.parametrize("table", ["admin", "query"])
@pytest.mark.parametrize("token", [" ", "\t \n", " s3cret", "s3cret ", "s3c\x00ret"])
def test_a_token_no_bearer_header_can_carry_is_refused_naming_it(table: str, token: str) -> None:
    """A client's `Bearer TOKEN` is read without the spaces around it: a token of spaces, or
    with spaces around it, matched no request and locked the API out, silently."""
    with pytest.raises(ConfigError, match=rf"{table}\.token") as refused:
        parse_config({table: {"token": token}})
    assert refused.value.key == f"{table}.token", refused.value
    assert token.strip() == "" or token.strip() not in str(refused.value)  # never echoed


@pytest.mark.parametrize(
    ("env", "key"), [("KVROUTE_ADMIN_TOKEN", "admin.token"), ("KVROUTE_QUERY_TOKEN", "query.token")]
)
def test_a_token_variable_no_bearer_header_can_carry_is_refused_naming_it(
    env: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable stands in for an empty key, and a whitespace-only one locked the API out
    as silently as the key did."""
    monkeypatch.setenv(env, " s3cret ")
    with pytest.raises(ConfigError, match=rf"\${env} begins or ends with whitespace") as refused:
        parse_config({})
    assert key in str(refused.value) and "s3cret" not in str(refused.value)
    # a key that is set wins over the variable, which is then not read
    assert parse_config({key.split(".")[0]: {"token": "fine"}})


@pytest.mark.parametrize("table", ["admin", "query"])
def test_a_token_with_inner_spaces_is_still_a_token(table: str) -> None:
    assert parse_config({table: {"token": "two words"}})


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("events", "garbage", "expected tcp://HOST:PORT"),
        ("events", "tcp://a:70000", "the port must be 1-65535"),
        ("events", ["tcp://a:5557", "udp://a:5558"], "expected tcp://HOST:PORT"),
        ("replay", "tcp://:5600", "expected tcp://HOST:PORT"),
        ("replay", "ipc://", "names no path"),
    ],
)
def test_event_endpoints_are_checked_when_read(key: str, value: object, said: str) -> None:
    # zmq would refuse them only inside the subscriber, which retries forever
    with pytest.raises(ConfigError, match=f"workers.{key} .*{said}"):
        parse_config({"workers": [{"url": "http://a:1", key: value}]})
    for good in ("tcp://*:5557", "tcp://10.0.0.1:1", "ipc:///run/kv.sock"):
        parse_config({"workers": [{"url": "http://a:1", key: good}]})


def test_a_worker_may_name_several_models() -> None:
    config = parse_config(
        {"workers": [{"url": "http://a:1", "model": "a"}, {"url": "http://b:1", "models": ["b"]}]}
    )
    assert [w.served_models for w in config.workers] == [("a",), ("b",)]
    with pytest.raises(ConfigError, match=r"workers\.models"):
        parse_config({"workers": [{"url": "http://a:1", "models": [""]}]})
    with pytest.raises(ConfigError, match="models"):
        parse_config({"workers": [{"url": "http://a:1", "models": "a"}]})


def test_constructible_in_code_with_defaults() -> None:
    config = RouterConfig(workers=(WorkerConfig(url="http://127.0.0.1:1"),))
    assert config.policy.name == "kv"
    assert config.workers[0].worker_id == "http://127.0.0.1:1"


def test_admin_token_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", "from-env")
    assert RouterConfig().admin_token() == "from-env"
    assert parse_config({"admin": {"token": "cfg"}}).admin_token() == "cfg"


def test_missing_and_broken_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy\nname = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path: Path) -> None:
    """Before, anything at the path was read to its end: a FIFO blocked the reader (on a reload,
    the router's event loop) until something wrote to it, and a symlink to /dev/zero was read
    until the kernel killed the router. Neither the open nor the read blocks now."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (zero, "a character device"), (tmp_path, "a directory")):
        with pytest.raises(ConfigError, match=f"is {kind}.*, not a regular file$") as refused:
            load_config(path)
        assert str(path) in str(refused.value)
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match=r"larger than 16777216 bytes \(16 MiB\)"):
        load_config(big)
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "nope.toml")
    # through a symlink to a regular file, as a deployment tool links one
    real = tmp_path / "real.toml"
    real.write_text("[listen]\nport = 7\n")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert load_config(link).listen.port == 7


def test_an_empty_file_is_refused_at_startup_and_read_again(tmp_path: Path) -> None:
    """At a start it was a config of defaults: a router of no workers on 127.0.0.1:8000."""
    path = tmp_path / "router.toml"
    for content in (b"", b" \n\t\n"):
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=r"is empty: a config gives at least"):
            load_config(path)
        with pytest.raises(ConfigError, match=r"is empty \(caught while being written"):
            load_config(path, reloading=True)
    path.write_bytes(b"# comments\n[listen]\n")
    with pytest.raises(ConfigError, match="has no settings, only comments or empty tables: a"):
        load_config(path)


def test_a_file_saved_in_place_while_read_again_is_never_taken_empty(tmp_path: Path) -> None:
    """A save that truncates the file and writes it again in place, under the reads of a
    reload: the emptiness check read the file, then the parser read it again, and a
    truncation between the two applied an empty file (every worker removed). The bytes
    checked are the bytes parsed now: a read sees the whole file or is refused."""
    from router.commands.serve import config_source

    path = tmp_path / "router.toml"
    text = '[[workers]]\nid = "a"\nurl = "http://127.0.0.1:1"\n' + "# padding\n" * 50
    path.write_text(text)
    source = config_source(argparse.Namespace(config=str(path)))
    stop = threading.Event()

    def save_in_place() -> None:
        while not stop.is_set():
            with path.open("w") as file:  # truncated here ...
                file.flush()
                stop.wait(0.0002)
                file.write(text)  # ... and written again
            stop.wait(0.0003)

    writer = threading.Thread(target=save_in_place)
    writer.start()
    counts = {"whole": 0, "refused": 0, "emptied": 0}
    try:
        for _ in range(3000):
            try:
                config = source.load()
            except ConfigError:  # empty (a read amid the write may also see a part of it)
                counts["refused"] += 1
                continue
            counts["whole" if config.workers else "emptied"] += 1
    finally:
        stop.set()
        writer.join()
    assert counts["emptied"] == 0, counts
    assert counts["whole"] and counts["refused"], counts  # the race did run both ways


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[listen]\nport = 0\n# caf\xe9\n")  # Latin-1, as an editor may save it
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert str(bad) in message and "not UTF-8" in message and "offset 23" in message


@pytest.mark.parametrize(
    "name",
    [
        "local.toml",
        "sglang-fleet.toml",
        "vllm-fleet.toml",
        "multi-model.toml",
        "dp.toml",
        "pd.toml",
    ],
)
def test_shipped_configs_load(name: str) -> None:
    load_config(CONFIGS / name)


def test_the_multi_model_example_serves_two_models() -> None:
    workers = load_config(CONFIGS / "multi-model.toml").workers
    pool = WorkerPool(BreakerConfig())
    for worker in workers:
        pool.add(worker)
    # the second 7B worker joins its pool once discovered
    assert pool.served() == ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-32B-Instruct", "qwen-32b")
    assert pool.resolve("qwen-32b").cache_model == "Qwen/Qwen2.5-32B-Instruct"
    # what its header says /v1/models and an unknown model's 404 list: those three names
    # (before: "both models, once each", "the two models")
    header = (CONFIGS / "multi-model.toml").read_text(encoding="utf-8").split("\n\n", 1)[0]
    assert header.count("three names") == 2, header
    assert "both models" not in header and "listing the two models" not in header, header


def test_every_limit_and_timeout_is_documented() -> None:
    doc = (CONFIGS.parent / "docs" / "router.md").read_text(encoding="utf-8")
    section = doc.split("## Limits and timeouts", 1)[1].split("\n## ", 1)[0]
    reference = doc.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    for table, struct in (("limits", LimitsConfig), ("timeouts", TimeoutsConfig)):
        for field in msgspec.structs.fields(struct):
            key = f"`{table}.{field.name}`"
            assert key in section and key in reference, key


def test_a_bootstrap_port_is_a_prefill_workers_and_roles_are_checked() -> None:
    from router.config import WorkerConfig

    assert WorkerConfig(url="http://h:1", role="prefill", bootstrap_port=8998).bootstrap_port
    assert WorkerConfig(url="http://h:1", bootstrap_port=8998).role is None  # discovered
    with pytest.raises(ValueError, match="bootstrap_port"):
        WorkerConfig(url="http://h:1", role="decode", bootstrap_port=8998)
    with pytest.raises(ConfigError, match="role"):
        parse_config({"workers": [{"url": "http://h:1", "role": "prefil"}]})


def test_every_policy_key_is_documented() -> None:
    from router.config import PolicyConfig

    doc = (CONFIGS.parent / "docs" / "router.md").read_text(encoding="utf-8")
    reference = doc.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    keys = {field.name for field in msgspec.structs.fields(PolicyConfig)}
    for name in keys:
        assert f"`policy.{name}`" in reference, name
    # and no row names a key that is not there (a pattern hid two that never existed)
    named = set(re.findall(r"`policy\.([a-z_*]+)`", reference))
    assert named <= keys, named - keys


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:4222", "must be nats:// or tls://"),
        ("nats://127.0.0.1:99999", "Port out of range"),
        ("nats://127.0.0.1:abc", "Port could not be cast"),
        ("nats://", "names no host"),
        ("nats://a:4222, nats://b:4222", "several servers go in a list"),
    ],
)
def test_a_cluster_url_the_nats_client_would_refuse_is_refused_when_read(
    url: str, said: str
) -> None:
    # refused inside the cluster's connect task, it took the router's startup down unexplained
    with pytest.raises(ConfigError, match=f"cluster.url .*{said}"):
        parse_config({"cluster": {"url": url}})
    parse_config({"cluster": {"url": ["nats://a:4222", "tls://[::1]:4222", "nats://b"]}})


@pytest.mark.parametrize(
    ("key", "value"),
    [("relay_max_age_s", 0.05), ("relay_max_bytes", 1000), ("events", "kafka")],
)
def test_relay_settings_nats_would_refuse_are_refused_when_read(key: str, value: object) -> None:
    # a max age under JetStream's 100 ms looped forever as "NATS does not answer"
    with pytest.raises(ConfigError, match=f"cluster.{key}"):
        parse_config({"cluster": {key: value}})


@pytest.mark.parametrize(
    "url",
    [
        "http://kvuser:s3cret-pass@127.0.0.1:4222",
        "nats://kvuser:s3cret-pass@127.0.0.1:abc",
        "nats://kvuser:s3cret/pass@127.0.0.1:4222",  # urlsplit would quote "s3cret" as a port
        "nats://kvuser:s3cret-pass@",
        "nats://kvuser:s3cret-pass@a:4222, nats://b:4222",
    ],
)
def test_a_refused_cluster_url_is_named_without_its_password(url: str) -> None:
    # the message reaches stderr and POST /admin/reload's answer
    with pytest.raises(ConfigError) as refused:
        parse_config({"cluster": {"url": url}})
    said = str(refused.value)
    assert "***@" in said and "s3cret" not in said and "kvuser" not in said, said


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://kvuser:s3cret-pass@10.0.0.5:4222", "nats://***@10.0.0.5:4222"),
        ("tls://a-token@10.0.0.5", "tls://***@10.0.0.5"),  # a token in the user's place
        ("nats://u:s3cret/p@ss@10.0.0.5", "nats://***@10.0.0.5"),  # unescaped / and @
        ("nats://10.0.0.5:4222", "nats://10.0.0.5:4222"),
    ],
)
def test_a_nats_url_is_shown_without_user_info(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    if "/" not in url.removeprefix("nats://"):  # else refused, and named so (above)
        cluster = parse_config({"cluster": {"url": [url]}}).cluster
        assert cluster is not None and cluster.shown_servers == [shown]


async def test_the_indexer_section_reaches_the_indexer() -> None:
    """Every `[indexer]` key is the indexer's setting: a SUB queue sized for a large fleet's
    bursts must really be the socket's."""
    doc = {
        "indexer": {
            "pending_ttl_s": 3.5,
            "stale_after_s": 12.0,
            "replay_timeout_s": 0.25,
            "probe_interval_s": 0,
            "live_check_interval_s": 7.5,
            "rcv_hwm": 7,
            "log_interval_s": 0,
            "restart_backoff_max_s": 1.5,
        }
    }
    # every setting of the indexer an operator may need (the loop's yield is an internal);
    # before, `live_check_interval_s` was the indexer's and no config file could set it
    assert set(doc["indexer"]) == set(IndexerConfig.__struct_fields__) - {"yield_every"}
    section = parse_config(doc).indexer
    async with RouterService(router_config([], indexer=section)) as router:
        settings = router.planner.indexer.config
    assert {key: getattr(settings, key) for key in doc["indexer"]} == doc["indexer"]
    with pytest.raises(ConfigError, match="rcv_hwm"):
        parse_config({"indexer": {"rcv_hwm": -1}})
    for bad in (0, -1, 3601, "x"):
        with pytest.raises(ConfigError, match="live_check_interval_s"):
            parse_config({"indexer": {"live_check_interval_s": bad}})


def test_medium_weights_name_known_tiers_with_finite_weights() -> None:
    for weights, said in (
        ({"GPUU": 3.0}, "unknown tier 'GPUU'"),  # a misspelled tier earned nothing, silently
        ({"GPU": float("inf")}, "medium_weights.GPU must be a finite number"),
    ):
        with pytest.raises(ConfigError, match=said):
            parse_config({"policy": {"medium_weights": weights}})
    with pytest.raises(ConfigError, match="hit_weight must be a finite"):
        parse_config({"policy": {"hit_weight": float("inf")}})
    assert parse_config({"policy": {"medium_weights": {"GPU": 1.0, "DISK": 0.0}}})
