"""The pool's models: which workers a request may go to, and how its `model` string resolves."""

from __future__ import annotations

import msgspec
import pytest

from indexer.engines import EngineName
from router.config import BreakerConfig, LimitsConfig, WorkerConfig
from router.errors import ModelUnavailableError, RequestError, UnknownModelError
from router.prompt.request import Endpoint, ParsedRequest
from router.routing.namespace import request_namespace
from router.routing.pool import (
    ModelChoice,
    WorkerPool,
    split_adapter,
    splits_served_name_first,
)


def _pool(*models: str | tuple[str, ...]) -> WorkerPool:
    """Worker i serves models[i] (a name, several names, or "" for none configured)."""
    pool = WorkerPool(BreakerConfig())
    for i, served in enumerate(models):
        names = ((served,) if served else ()) if isinstance(served, str) else served
        pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=f"w{i}", models=names))
    return pool


def _ids(pool: WorkerPool, model: str) -> list[str]:
    return [e.id for e in pool.serving(pool.resolve(model).cache_model)]


# SGLang 0.5.23, OpenAIServingBase._parse_model_parameter, with its one served name "m" (and
# an object-storage name holding colons, the one kind its validation lets contain ":")
@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [
        ("m", ["m"], ("m", None)),
        ("m:lora", ["m"], ("m", "lora")),
        ("m:lora:v2", ["m"], ("m", "lora:v2")),  # split once
        ("default:lora", ["m"], ("default", "lora")),  # the base is not checked: first colon
        ("m: lora ", ["m"], ("m", "lora")),  # both halves stripped
        (" x :lora", ["m"], ("x", "lora")),
        ("m:", ["m"], ("m", None)),  # an empty adapter is none
        ("m:  ", ["m"], ("m", None)),
        (" m ", ["m"], (" m ", None)),  # no colon: the name as given, unstripped
        ("s3://b/m", ["s3://b/m"], ("s3://b/m", None)),  # the exact served name
        ("s3://b/m:lora", ["s3://b/m"], ("s3://b/m", "lora")),  # the served name first
        ("s3://b/m:lora", ["m"], ("s3", "//b/m:lora")),
        # several served names (a router's generalisation): the longest that fits
        ("a:b:c", ["a", "a:b"], ("a:b", "c")),
        ("a:b", ["a", "a:b"], ("a:b", None)),
    ],
)
def test_split_adapter_reads_the_model_as_sglang_does(
    model: str, served: list[str], expected: tuple[str, str | None]
) -> None:
    assert split_adapter(model, served) == expected


@pytest.mark.parametrize(
    ("engine", "version", "expected"),
    [
        ("sglang", "0.5.23", True),
        ("sglang", "0.5.23.post1", True),
        ("sglang", "0.5.23-kvroute", True),  # the reference workers
        ("sglang", "0.5.22", False),  # 0.5.17-0.5.22: the first ":" splits
        ("sglang", "0.5.17", False),
        ("sglang", "0.5.16", None),  # before the supported range: not read
        ("sglang", "0.5.24", None),  # after it: not read either
        ("sglang", "0.5.23rc0", None),
        ("sglang", None, None),
        ("sglang", "", None),
        ("vllm", None, True),  # names an adapter by itself: read by `resolve`
    ],
)
def test_how_a_worker_reads_a_model_with_a_colon_comes_from_its_sglang_version(
    engine: str, version: str | None, expected: bool | None
) -> None:
    assert splits_served_name_first(engine, version) is expected


def test_a_model_is_contested_where_the_first_colon_is_not_where_0_5_23_splits() -> None:
    pool = _pool("org/m:v1", "s3://bk/m", "plain")
    for model in ("org/m:v1", "org/m:v1:L1", "s3://bk/m", "s3://bk/m:L1"):
        assert pool.split_contested(model), model
    for model in ("plain", "plain:L1", "other:L1", "org/m", "s3"):
        assert not pool.split_contested(model), model


def test_a_fleet_of_several_models_plans_each_request_among_its_own_workers() -> None:
    pool = _pool("a", "a", "b")
    assert pool.served() == ("a", "b")
    assert _ids(pool, "a") == ["w0", "w1"] and _ids(pool, "b") == ["w2"]
    assert _ids(pool, "a:adapter") == ["w0", "w1"]
    assert pool.resolve("a:adapter") == ModelChoice("a", "a", "adapter")
    for model in ("c", "", "default", "c:a"):
        with pytest.raises(UnknownModelError) as refused:
            pool.resolve(model)
        assert refused.value.served == ("a", "b") and refused.value.status == 404


def test_a_one_model_fleet_takes_any_name_and_every_worker() -> None:
    pool = _pool("m", "m", "")
    pool.set_models(pool.get("w2"), ())  # registered: it advertises no model
    for model in ("m", "default", "", "other:adapter"):
        assert _ids(pool, model) == ["w0", "w1", "w2"]
        assert pool.resolve(model).cache_model == "m"
    assert pool.resolve("default").model == "m"
    assert pool.resolve("other:adapter").adapter == "adapter"
    # a fleet that names no model at all is one pool too
    unnamed = _pool("", "")
    for entry in unnamed:
        unnamed.set_models(entry, ())
    assert unnamed.resolve("anything") == ModelChoice("", "", None)
    assert _ids(unnamed, "anything") == ["w0", "w1"]


@pytest.mark.parametrize("then", ["y", "x"])
def test_one_known_model_is_no_one_pool_while_a_workers_models_are_unknown(then: str) -> None:
    """w1's models are not known yet (down when the router started, or its server info too
    slow): it may serve another model than w0's. Each request goes to the known workers of
    the name it gives, a name none of them serves is a 503 to retry, and w1 takes nothing
    until it registers. Before, the fleet was one pool of x meanwhile: requests naming y (or
    any name) were answered by w0's model, and w1 was sent x's requests."""
    pool = _pool("x", "")
    assert _ids(pool, "x") == ["w0"] and _ids(pool, "x:adapter") == ["w0"]
    for model in ("y", "y:adapter", "llama"):
        with pytest.raises(ModelUnavailableError) as unsure:
            pool.resolve(model)
        assert unsure.value.status == 503 and unsure.value.served == ("x",)
    # a request naming no model takes the one the known workers serve, never w1 (else every
    # such request would wait for a worker still loading its model, or one just added)
    for model in ("default", ""):
        assert _ids(pool, model) == ["w0"] and pool.resolve(model).model == "x"
    pool.set_models(pool.get("w1"), (then,))  # registered
    if then == "y":  # two models: each its own pool, any other name a 404
        assert _ids(pool, "x") == ["w0"] and _ids(pool, "y") == ["w1"]
        with pytest.raises(UnknownModelError):
            pool.resolve("default")
    else:  # one model after all: one pool again, taking any name
        assert _ids(pool, "default") == ["w0", "w1"] and _ids(pool, "x") == ["w0", "w1"]


def test_a_lone_worker_of_unknown_model_takes_nothing_until_it_registers() -> None:
    """A fleet of one worker, down when the router started: a 503 to retry for any name (its
    health check failing, it took nothing before either: a NoWorkerError). Once it registers,
    a one-model fleet: any name is its."""
    pool = _pool("")
    for model in ("m", "default", ""):
        with pytest.raises(ModelUnavailableError) as unsure:
            pool.resolve(model)
        assert unsure.value.served == () and "1 worker(s) are not known yet" in str(unsure.value)
    pool.set_models(pool.get("w0"), ("m",))
    for model in ("m", "default", ""):
        assert _ids(pool, model) == ["w0"]


def test_a_worker_of_unknown_model_takes_nothing_once_the_fleet_serves_several() -> None:
    pool = _pool("a", "b", "")
    assert _ids(pool, "a") == ["w0"] and _ids(pool, "b") == ["w1"]
    pool.set_models(pool.get("w2"), ("b",))  # discovered
    assert _ids(pool, "b") == ["w1", "w2"]
    assert pool.get("w2").cache_model == "b"


def test_a_model_is_unknown_only_once_every_workers_models_are_known() -> None:
    """While a worker's models are unknown (not registered: down, being discovered) a name no
    known worker serves may be its: a 503 to retry, not a 404 (OpenAI clients do not retry
    one). Before, a 404, also for a model whose workers were all being replaced."""
    pool = _pool("a", "b", "")
    with pytest.raises(ModelUnavailableError) as unsure:
        pool.resolve("c")
    assert unsure.value.status == 503 and unsure.value.served == ("a", "b")
    pool.set_models(pool.get("w2"), ("b",))  # discovered: every worker's models known
    with pytest.raises(UnknownModelError) as refused:
        pool.resolve("c")
    assert refused.value.status == 404
    # a one-model fleet whose workers are all replaced: the newcomer's models are unknown
    swapped = _pool("m")
    swapped.add(WorkerConfig(url="http://127.0.0.1:9", id="w9"))
    swapped.remove("w0")
    for model in ("m", "m:adapter"):
        with pytest.raises(ModelUnavailableError):
            swapped.resolve(model)
    swapped.set_models(swapped.get("w9"), ("m",))
    assert _ids(swapped, "m") == ["w9"]


def test_an_empty_pool_refuses_no_model_as_unknown() -> None:
    """Its last worker removed (renamed, on a replica reading another's reload): nothing is
    known not to be served, so a 503 with Retry-After. Before, a 404 model_not_found saying
    "this fleet serves " and no model, which OpenAI clients do not retry."""
    pool = _pool("m")
    pool.remove("w0")
    for model in ("m", "m:adapter"):
        with pytest.raises(ModelUnavailableError) as unsure:
            pool.resolve(model)
        assert unsure.value.status == 503 and unsure.value.served == ()
        assert unsure.value.headers() == {"Retry-After": "1"}
        assert "the fleet has no worker now" in str(unsure.value)


def test_membership_and_discovery_reshape_the_pools() -> None:
    pool = _pool("a", "b")
    gone = pool.remove("w1")
    # one model left: it takes every name again, but not the one whose last worker went (its
    # requests would get model a's answers)
    assert _ids(pool, "default") == ["w0"]
    for model in ("b", "b:adapter"):
        with pytest.raises(UnknownModelError) as refused:
            pool.resolve(model)
        assert refused.value.served == ("a",)
    pool.set_models(gone, ("c",))  # a late discovery of a removed worker changes nothing
    assert pool.served() == ("a",)
    pool.add(WorkerConfig(url="http://127.0.0.1:9", id="w9", model="b"))
    assert _ids(pool, "b") == ["w9"]
    with pytest.raises(UnknownModelError):
        pool.resolve("c")


def test_a_worker_back_serving_another_model_does_not_answer_for_the_old_one() -> None:
    pool = _pool("a", "b")
    pool.set_models(pool.get("w0"), ("b",))  # restarted serving b: one pool of b
    assert _ids(pool, "default") == ["w0", "w1"]
    with pytest.raises(UnknownModelError):
        pool.resolve("a")
    pool.set_models(pool.get("w1"), ("a",))  # a served again: a fleet of two models
    assert _ids(pool, "a") == ["w1"] and _ids(pool, "b") == ["w0"]


def test_a_served_name_with_a_colon_outlives_a_gone_model_named_like_its_prefix() -> None:
    pool = _pool("qwen", "qwen:7b", "other")
    pool.remove("w0")  # qwen's last worker
    assert pool.resolve("qwen:7b") == ModelChoice("qwen:7b", "qwen:7b", None)
    assert _ids(pool, "qwen:7b:sql") == ["w1"] and pool.resolve("qwen:7b:sql").adapter == "sql"
    for gone in ("qwen", "qwen:sql"):
        with pytest.raises(UnknownModelError):
            pool.resolve(gone)


def test_only_pools_of_sglang_workers_read_lora_path_as_an_adapter() -> None:
    def pool(*engines: EngineName, models: tuple[str, ...] = ("m",)) -> WorkerPool:
        built = WorkerPool(BreakerConfig())
        for i, engine in enumerate(engines):
            model = models[i % len(models)]
            built.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", model=model, engine=engine))
        return built

    chat = ParsedRequest(endpoint=Endpoint.CHAT, body=b"", salt=None, model="m", lora="sql",
                         tokens=[1, 2], stream=False)  # fmt: skip

    def lora(built: WorkerPool, model: str = "m") -> str | None:
        return request_namespace(chat, built.resolve(model), LimitsConfig()).lora

    assert lora(pool("sglang", "sglang")) == "sql"
    # vLLM ignores the field (not one of its own) and serves the base model: its pages
    assert lora(pool("vllm", "vllm")) is None
    # per model in a fleet of several: each pool by its own workers
    several = pool("vllm", "sglang", models=("a", "b"))
    assert lora(several, "a") is None and lora(several, "b") == "sql"
    # an adapter named as the model stays the adapter on either engine, each by its spelling
    limits = LimitsConfig()
    assert request_namespace(chat, pool("vllm").resolve("sql-lora"), limits).lora == "sql-lora"
    assert request_namespace(chat, pool("sglang").resolve("m:ad"), limits).lora == "ad"


def test_an_adapter_the_model_names_is_bounded_and_the_served_name_is_not() -> None:
    # the QA report: "<served>:" + 2 MB became a namespace of that name (so did a vLLM pool's
    # unserved 2 MB model, read as an adapter's), listed by /admin/namespaces and the dashboard
    limits = LimitsConfig(max_adapter_name_bytes=8)
    long_served = "s" * 100
    chat = ParsedRequest(endpoint=Endpoint.CHAT, body=b"", salt=None, model="", lora=None,
                         tokens=[1], stream=False)  # fmt: skip

    def namespace(engine: EngineName, model: str) -> str | None:
        built = WorkerPool(BreakerConfig())
        built.add(WorkerConfig(url="http://127.0.0.1:1", model=long_served, engine=engine))
        asked = msgspec.structs.replace(chat, model=model)
        return request_namespace(asked, built.resolve(model), limits).lora

    assert namespace("sglang", long_served) is None  # a served name: as long as it is
    assert namespace("sglang", long_served + ":a" * 4) == "a:a:a:a"  # 7 bytes
    assert namespace("vllm", "é" * 4) == "é" * 4  # 8 bytes, named by itself
    refused = r"^model names a LoRA adapter longer than limits.max_adapter_name_bytes \(8 bytes\)$"
    over: list[tuple[EngineName, str]] = [
        ("sglang", long_served + ":" + "a" * 9),
        ("vllm", "é" * 4 + "x"),
    ]
    for engine, model in over:
        with pytest.raises(RequestError, match=refused):
            namespace(engine, model)


def test_aliases_share_the_cache_of_their_first_name() -> None:
    # vLLM serves several names; its events are indexed under the first
    pool = _pool(("llama-3", "llama"), ("llama-3", "llama"), "qwen")
    assert pool.served() == ("llama-3", "llama", "qwen")
    assert pool.resolve("llama") == ModelChoice("llama", "llama-3", None)
    assert _ids(pool, "llama") == ["w0", "w1"]
    # listed unevenly, a name keeps its own workers (and its own cache name)
    uneven = _pool(("llama-3", "llama"), "llama-3", "qwen")
    assert uneven.resolve("llama") == ModelChoice("llama", "llama", None)
    assert _ids(uneven, "llama") == ["w0"] and _ids(uneven, "llama-3") == ["w0", "w1"]
    # aliases alike on every worker: still a one-model fleet
    alike = _pool(("x", "y"), ("x", "y"))
    assert alike.resolve("default") == ModelChoice("x", "x", None)
    assert alike.resolve("y") == ModelChoice("y", "x", None)


def test_config_names_models_once_first_name_first() -> None:
    assert WorkerConfig(url="http://a:1", model="a", models=("b", "a")).served_models == (
        "a",
        "b",
    )
    assert WorkerConfig(url="http://a:1", models=("b", "c")).served_models == ("b", "c")
    assert WorkerConfig(url="http://a:1").served_models == ()
    with pytest.raises(ValueError, match=r"workers\.models"):
        WorkerConfig(url="http://a:1", models=("b", " "))
