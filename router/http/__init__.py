"""The router on the wire: its aiohttp application and everything that speaks HTTP.

Request path: `listener` (aiohttp's server: client deadlines, connection cap, malformed HTTP) ->
`app` (the application factory, error middleware, the resources it owns) -> `proxy` (the
upstream hop: streaming, retries) -> `intake` (body and salt header within the limits, parsed by
`router.prompt`) -> `router.routing` for the decision.

- `admin`: the `/admin` API (workers, namespaces, streams, route dry run, index dump/load);
- `dashboard/`: the live page at `/dashboard` (admin token), its login and the state it polls;
- `metrics`: the Prometheus metrics of one router;
- `holding`: the requests `policy.hold_until_room` holds, queued by the rank each waits for;
- `keys`: the typed application keys naming the app's shared objects.

Nothing is imported here, so `kvroute --help` stays light.
"""
