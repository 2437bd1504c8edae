"""Reference workers: a CPU simulation of an SGLang worker's paged radix KV cache.

- `cache`: the paged radix cache with cache_salt namespaces, LRU eviction, KV events (pure);
- `hashing`: SGLang's event block hashes (plain and salted chains, dynamo namespacing);
- `io_struct`: request normalization (cache_salt/extra_key checks, batches, OpenAI bodies);
- `scheduler`: one DP rank's waiting queue, running batch and latency model;
- `publisher`: the ZMQ PUB stream and ROUTER replay service of one DP rank;
- `disagg`: prefill/decode roles: the KV handoff, a prefill's bootstrap server, a decode's fetch
  (SGLang's bootstrap room and vLLM's kv_transfer_params);
- `server`: the SGLang/OpenAI-compatible HTTP API (aiohttp);
- `listener`: the aiohttp server under it, answering malformed requests in JSON, quietly;
- `worker`: `ReferenceWorker`, one worker as an in-process async service;
- `fleet`: `Fleet`, N workers on 127.0.0.1 for `kvroute up`, tests and benchmarks;
- `command`: the `kvroute worker` verb; `config`: `WorkerConfig`; `errors`: the error tree.

Only `indexer.protocol` is imported from the rest of kvroute.
"""

from __future__ import annotations

from workers.config import WorkerConfig
from workers.fleet import Fleet, FleetWorker
from workers.worker import KvEventsInfo, ReferenceWorker

__all__ = ["Fleet", "FleetWorker", "KvEventsInfo", "ReferenceWorker", "WorkerConfig"]
