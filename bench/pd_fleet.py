"""The routing benchmark's prefill/decode fleet: prefill and decode reference workers, paired.

`FleetSpec.prefill_workers` prefill workers and `decode_workers` decode workers, each with the
same cache and latency model as a flat fleet's workers; the decode side pays
`transfer_ms_per_token` for the KV it is sent. Before a router run, each worker's KV-event path
is proven live with tiny pairs sent straight to (prefill, decode), since a PD worker serves only
pairs. SGLang's own router fronts the same fleet in its PD mode (`--pd-disaggregation`, its
`cache_aware` policy on the prefill side), told each prefill's bootstrap port.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping

import aiohttp
import msgspec

from indexer.stats import StreamState
from router.service import RouterService
from workers.config import WorkerConfig, WorkerRole
from workers.worker import ReferenceWorker

__all__ = ["await_pd_streams", "pd_config", "pd_names", "poke_pair", "sglang_pd_args"]


def pd_names(prefills: int, decodes: int) -> list[tuple[str, WorkerRole]]:
    """(name, role) of every worker of a PD fleet, prefill workers first."""
    names: list[tuple[str, WorkerRole]] = [(f"p{i}", "prefill") for i in range(prefills)]
    return names + [(f"d{i}", "decode") for i in range(decodes)]


async def poke_pair(
    session: aiohttp.ClientSession,
    prefill: ReferenceWorker,
    decode: ReferenceWorker,
    ids: list[int],
    room: int,
) -> None:
    """One SGLang pair sent straight to (prefill, decode): both cache `ids` and publish."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": prefill.config.host,
        "bootstrap_port": prefill.disagg.bootstrap_port,
        "bootstrap_room": room,
    }
    answers = await asyncio.gather(
        session.post(prefill.url + "/generate", json=body),
        session.post(decode.url + "/generate", json=body),
    )
    for resp in answers:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"a warm-up pair failed: HTTP {resp.status}: {text[:200]}")


async def await_pd_streams(
    service: RouterService, workers: Mapping[str, ReferenceWorker], page_size: int, seed: int
) -> None:
    """Poke pairs until the router's indexer has applied a page from every worker's stream."""
    rng = random.Random(seed ^ 0x9D)
    prefills = [(n, w) for n, w in workers.items() if w.config.role == "prefill"]
    decodes = [(n, w) for n, w in workers.items() if w.config.role == "decode"]
    async with aiohttp.ClientSession() as session, asyncio.timeout(20.0):
        while True:
            live = {
                s.worker
                for s in service.indexer.streams()
                if s.state == StreamState.SYNCED and s.blocks_stored > 0
            }
            if all(name in live for name in workers):
                return
            pairs = [(p, decodes[i % len(decodes)][1]) for i, (_, p) in enumerate(prefills)]
            pairs += [(prefills[i % len(prefills)][1], d) for i, (_, d) in enumerate(decodes)]
            for prefill, decode in pairs:
                ids = [rng.randrange(3, 259) for _ in range(page_size + 1)]
                await poke_pair(session, prefill, decode, ids, rng.randrange(2**62))
            await asyncio.sleep(0.05)


def sglang_pd_args(workers: Mapping[str, ReferenceWorker]) -> list[str]:
    """sglang-router's PD-mode arguments for the fleet (`--prefill URL BOOTSTRAP_PORT`)."""
    args = ["--pd-disaggregation"]
    for worker in workers.values():
        if worker.config.role == "prefill":
            args += ["--prefill", worker.url, str(worker.disagg.bootstrap_port)]
        elif worker.config.role == "decode":
            args += ["--decode", worker.url]
    return args


def pd_config(base: WorkerConfig, role: WorkerRole) -> WorkerConfig:
    """A flat fleet worker's config, in a role."""
    return msgspec.structs.replace(base, role=role)
