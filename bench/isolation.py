"""Cross-tenant cache hits: cached tokens a worker can only have served from another salt.

The reference workers keep every `cache_salt` apart in their radix cache, and are
deterministic (each prompt always gets the same output, and a finished request caches its
prompt and output but the last token). So what a worker may legitimately report as cached for a
request is bounded by what the same salt sent before: a router that forwards the salt can never
make a worker report more. A router that drops the salt on the way (sglang-router 0.3.2 does
on `/generate` and `/v1/chat/completions`) puts every tenant into the workers' one unsalted
namespace, and tenant B is served tenant A's pages. Two measures, both counted as isolation
violations, never as hits:

- over a workload (`workload_violations`): per request, the longest page-aligned prefix of its
  prompt (less the last token, which is never reused) that the same salt's requests sent before
  its first byte (prompts and their cached outputs) to the same worker could explain; the
  worker's `cached_tokens` beyond it are a violation. The worker is the one that says it served
  the request (`X-Reference-Worker`, passed on by every router); its DP ranks and tiers count
  as one cache, and where the worker is unknown (prefill/decode fleets) any worker explains: a
  lower bound, never a false alarm;
- per endpoint (`probe_isolation`): pairs of requests, each with a salt of its own, the second
  sending the first's prompt after the first has finished; any cached token of either is a
  violation (no request of its salt came before it). It covers `/generate`,
  `/v1/completions` and `/v1/chat/completions`, where the workload only sends `/generate`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.probe_request import post_probe
from bench.routing_results import EndpointIsolation, RequestRecord
from bench.workloads import BenchRequest
from workers.scheduler import deterministic_output

__all__ = ["ENDPOINTS", "probe_isolation", "workload_violations"]

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
_WORDS = "abcdefghijklmnopqrstuvwxyz"


class _Prefixes:
    """Page-aligned prefixes sent per salt, each counting the requests that sent it."""

    def __init__(self, page_size: int) -> None:
        self._page = page_size
        self._ids: dict[tuple[object, tuple[int, ...]], int] = {}
        self._senders: dict[int, int] = {}
        self._next = itertools.count(1)

    def add(self, salt: str | None, tokens: Sequence[int]) -> None:
        parent: object = ("root", salt)
        for at in range(0, len(tokens) - self._page + 1, self._page):
            key = (parent, tuple(tokens[at : at + self._page]))
            node = self._ids.get(key)
            if node is None:
                node = self._ids[key] = next(self._next)
            self._senders[node] = self._senders.get(node, 0) + 1
            parent = node

    def explained(self, salt: str | None, prompt: Sequence[int], others: int) -> int:
        """Tokens of `prompt` sent by more than `others` requests of `salt` (whole pages)."""
        parent: object = ("root", salt)
        limit = max(0, len(prompt) - 1)
        at = 0
        while at + self._page <= limit:
            node = self._ids.get((parent, tuple(prompt[at : at + self._page])))
            if node is None or self._senders[node] <= others:
                break
            parent = node
            at += self._page
        return at


def workload_violations(
    requests: Sequence[BenchRequest],
    records: Sequence[RequestRecord],
    page_size: int,
    *,
    by_worker: bool = True,
) -> None:
    """Set each completed record's `violation_tokens`: cached tokens that no request of its own
    salt sent before its first byte could explain.

    `by_worker`: only requests the same worker served explain (each record's `served_by`, the
    worker's own word); requests of unknown worker explain everywhere. Off for prefill/decode
    fleets, whose answers name the decode worker while the prefill worker's cache is reused.
    """
    sends = sorted((r.sent_s, r.index) for r in records)
    by_index = {r.index: r for r in records}
    scopes = {r.served_by for r in records if r.served_by} if by_worker else set()
    done = [r for r in records if r.ok]
    firsts = sorted(done, key=lambda r: r.sent_s + (r.ttft_s or r.e2e_s or 0.0))
    fleet = _Prefixes(page_size)
    per_worker = {scope: _Prefixes(page_size) for scope in scopes}
    pending = iter(sends)
    upcoming = next(pending, None)
    for record in firsts:
        first_byte = record.sent_s + (record.ttft_s or record.e2e_s or 0.0)
        while upcoming is not None and upcoming[0] <= first_byte:
            req = requests[upcoming[1]]
            # what the worker caches of it: the prompt, then prompt + output but the last token
            out = deterministic_output(req.input_ids, req.max_new_tokens)
            cached = [*req.input_ids, *out[:-1]]
            fleet.add(req.cache_salt, cached)
            scope = by_index[upcoming[1]].served_by
            for name in (scope,) if scope in per_worker else per_worker:
                per_worker[name].add(req.cache_salt, cached)
            upcoming = next(pending, None)
        req = requests[record.index]
        seen = per_worker.get(record.served_by, fleet)
        # the record's own request is among the senders: it must not explain itself
        legit = seen.explained(req.cache_salt, req.input_ids, others=1)
        record.violation_tokens = max(0, record.cached_tokens - legit)


def _cached(data: Any) -> int:
    """`cached_tokens` of a non-streamed answer of any of the three endpoints."""
    if not isinstance(data, dict):
        return 0
    meta = data.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return int(meta["cached_tokens"])
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return 0


def _body(endpoint: str, text: str, salt: str, model: str | None) -> dict[str, Any]:
    if endpoint == "/generate":
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "cache_salt": salt,
        }
    body: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "cache_salt": salt}
    if model is not None:  # sglang-router's typed OpenAI requests require it
        body["model"] = model
    if endpoint == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


async def _model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model `url` lists on `/v1/models` (None if it lists none)."""
    try:
        async with asyncio.timeout(10.0), session.get(url + "/v1/models") as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        found = models[0].get("id")
        return found if isinstance(found, str) else None
    return None


async def probe_isolation(
    session: aiohttp.ClientSession,
    url: str,
    seed: int,
    *,
    pairs: int = 3,
    prompt_chars: int = 320,
    timeout_s: float = 30.0,
) -> list[EndpointIsolation]:
    """Send `pairs` same-prompt pairs under two fresh salts to each endpoint of `url`, one
    after the other; count the cached tokens either got (all of them violations)."""
    rng = random.Random(seed ^ 0x150)
    model = await _model(session, url)
    out: list[EndpointIsolation] = []
    for endpoint in ENDPOINTS:
        result = EndpointIsolation(endpoint=endpoint, requests=0)
        for pair in range(pairs):
            words = [
                "".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 9)))
                for _ in range(prompt_chars // 6)
            ]
            text = " ".join(words)[:prompt_chars]
            for side in "AB":
                salt = f"isolation-probe-{seed}-{endpoint}-{pair}-{side}"
                body = _body(endpoint, text, salt, model)
                answer, error = await post_probe(session, url + endpoint, body, timeout_s)
                if error:
                    result.errors += 1
                    result.error = error
                    continue
                cached = _cached(answer)
                result.requests += 1
                if cached > 0:
                    result.violating += 1
                    result.violation_tokens += cached
        out.append(result)
    return out
