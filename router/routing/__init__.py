"""Where a request goes: the routing core, plain synchronous code (no aiohttp, no awaits).

- `planner`: one decision: index lookup + health + load, ranked by the policy (`plan` is the
  read-only half behind `/admin/route`, `commit` the half that changes state); a candidate is
  a (worker, dp rank) for a worker with several data-parallel ranks;
- `policy`: the routing policies (`kv`, `round_robin`, `random`, `least_load`, `approx_tree`);
- `approx_tree`: the prefix tree of past decisions behind `approx_tree`;
- `load`: the router's own in-flight bookkeeping per (worker, dp rank);
- `pool`: the workers, their routing status and the workers of each served model (a request's
  `model`, `base:adapter` included, resolved to one); `breaker`: the per-worker circuit breaker;
- `namespace`: a request's cache namespace and the keyed fingerprints shown instead of salts.

Nothing is imported here, so `kvroute --help` stays light.
"""
