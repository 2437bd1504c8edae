"""The kvroute router: HTTP proxy, routing policies, admin API, config and CLI.

One package per kind of work, lowest layer first (`tests/test_layering.py` holds them to it: a
module imports its own layer and those below, never one above):

- `config`: the TOML config as typed structs; `errors`: the error tree;
- `prompt/`: a request body to what routing needs: body parsing and validation (`request`),
  tokens (`tokenizer`), the model's chat template (`chat_template`), each engine's chat
  conventions (`conventions`, `messages`), the JSON nesting bound (`nesting`);
- `routing/`: the decision, synchronous: `planner` (index lookup + health + load, ranked by a
  `policy`), `approx_tree`, `load`, `pool` (workers and the models they serve), `breaker`,
  `namespace`;
- `fleet/`: the workers behind the router: `supervisor` (membership, health loop),
  `registration` and `rereads` (registering a worker, and anew when its settings changed),
  `false_hit_response` (what a streak of false hits does) and `discovery` (KV-event streams and
  served models from a worker's config, `/server_info` and `/v1/models`);
- `http/`: the router on the wire: `listener` -> `app` -> `proxy` (with `intake`), `admin`,
  `metrics`, `keys`;
- `service`: `RouterService`, a whole router as an async context manager;
- `commands/`: the `kvroute` verbs: `cli` (dispatcher), `serve`, `up`, `record`, `replay`.

Request path: `http.listener` -> `http.app` -> `http.proxy` -> `http.intake` ->
`prompt.request` -> `routing.planner` -> the upstream worker (`/admin/route` plans the same way
and forwards nothing).

Nothing is imported here, so `kvroute --help` stays light.
"""
