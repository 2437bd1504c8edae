"""Where a request goes: the routing core, plain synchronous code (no aiohttp, no awaits).

- `planner`: one decision: index lookup + health + load, ranked by the policy (`plan` is the
  read-only half behind `/admin/route`, `commit` the half that changes state); a candidate is
  a (worker, dp rank) for a worker with several data-parallel ranks;
- `policy`: the routing policies (`kv`, `round_robin`, `random`, `least_load`, `approx_tree`);
- `approx_tree`: the prefix tree of past decisions behind `approx_tree`;
- `admission`: what a worker will still hold when it admits a request (its capacity, the
  queue ahead, the router's own LRU order of its blocks: `RecencyBook`);
- `eviction_cost`: the hot, sole-held blocks a request's own allocation would evict;
- `balance`: `decode_weight` learned from observed time to first token;
- `load`: the router's own in-flight bookkeeping per (worker, dp rank);
- `pool`: the workers, their routing status and the workers of each served model (a request's
  `model`, `base:adapter` included, resolved to one); `breaker`: the per-worker circuit breaker;
- `namespace`: a request's cache namespace and the keyed fingerprints shown instead of salts.

Nothing is imported here, so `kvroute --help` stays light.
"""
