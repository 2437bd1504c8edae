"""The kvroute router: HTTP proxy, routing policies, admin API, config and CLI.

Request path: `listener` (aiohttp's server: client deadlines, connection cap, malformed HTTP) ->
`app` (aiohttp application, error middleware, resources) -> `proxy` (upstream hop, streaming,
retries) -> `intake` (body and salt header within the limits) -> `request` (body validation,
namespace fields, tokens via `tokenizer`; nesting depth by `nesting`) -> `scheduler` (index
lookup + health + load, ranked by `policy`; `/admin/route` reads through `intake` and uses it too).

- `policy`: the pure routing policies (`kv`, `round_robin`, `random`, `least_load`,
  `approx_tree` over `approx_tree.ApproxTree`);
- `load`: the router's own in-flight bookkeeping; `breaker`: per-worker circuit breaker;
- `pool`: the workers and their status; `supervisor`: discovery, registration, health checks;
- `discovery`: KV-event streams from a worker's config and `/server_info`;
- `namespace`: request namespaces and the keyed fingerprints shown instead of salts;
- `admin`: the `/admin` API; `metrics`: Prometheus metrics; `keys`: typed app keys;
- `config`: the TOML config as typed structs; `errors`: the error tree;
- `service`: `RouterService`, a whole router as an async context manager;
- CLI verbs: `cli` (dispatcher), `serve`, `up`, `record_command`, `replay_command`.

Nothing is imported here, so `kvroute --help` stays fast.
"""
