"""Affinity: does a router send a prompt it has already routed back to the worker holding it?

On an idle fleet, with nothing in flight, a cache-aware router has no load to weigh against a
prefix: every such router should send a repeated prompt where its pages are. The probe sends
`prompts` fresh prompts of random token ids one after the other, then each again, `rounds - 1`
times over, every request finished before the next is sent, and counts the repeats whose worker
reported cached tokens. Only the prompt's own earlier copy can explain a hit (its ids are random,
its salt its own), so a repeat that finds nothing went to a worker that never saw it.

Why it is measured: the fidelity table holds `approx_tree` (kvroute's mirror of SGLang's
`cache_aware`) against the real sglang-router, section by section. Where the real router does
not apply that policy in some mode of its own, the comparison measures the mode, not the
mirror, and the probe's figure beside it says so in the same run. (sglang-router 0.3.2 in its
prefill/decode mode sent about half of such repeats to the other prefill worker, `text` or
`input_ids`, whatever its `--prefill-policy`; in its plain mode, none.)
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp

from bench.probe_request import post_probe
from bench.routing_results import AffinityProbe

__all__ = ["probe_affinity"]


def _cached(data: Any) -> int | None:
    """`meta_info.cached_tokens` of a non-streamed `/generate` answer (None: not there)."""
    meta = data.get("meta_info") if isinstance(data, dict) else None
    cached = meta.get("cached_tokens") if isinstance(meta, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


async def probe_affinity(
    session: aiohttp.ClientSession,
    url: str,
    seed: int,
    *,
    prompts: int = 4,
    rounds: int = 3,
    prompt_tokens: int = 160,
    timeout_s: float = 30.0,
) -> AffinityProbe:
    """Send `prompts` fresh prompts `rounds` times in turn to `url`'s `/generate`, one at a
    time; count the repeats (every round after the first) that found cached tokens."""
    rng = random.Random(seed ^ 0xAFF)
    ids = [[rng.randrange(3, 259) for _ in range(prompt_tokens)] for _ in range(prompts)]
    result = AffinityProbe()
    for round_ in range(rounds):
        for n, prompt in enumerate(ids):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "cache_salt": f"affinity-probe-{seed}-{n}",
            }
            answer, error = await post_probe(session, url + "/generate", body, timeout_s)
            if error:
                result.errors += 1
                result.error = error
                continue
            cached = _cached(answer)
            if cached is None:
                result.errors += 1
                result.error = "no meta_info.cached_tokens in the answer"
                continue
            if round_ > 0:
                result.repeats += 1
                result.kept += cached > 0
    return result
