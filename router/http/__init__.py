"""The router on the wire: its aiohttp application and everything that speaks HTTP.

Request path: `listener` (aiohttp's server: client deadlines, connection cap, malformed HTTP) ->
`app` (the application factory, error middleware, the resources it owns) -> `proxy` (the
upstream hop: retries; the answer back through `answer_relay`) -> `intake` (body and salt
header within the limits, parsed by `router.prompt`) -> `router.routing` for the decision.

- `answer_relay`: the worker's answer passed through to the client, whole or streamed;
- `request_body`: a request body decoded from its Content-Encoding (the listener leaves it
  as sent), whole or refused;
- `hop_headers`: the hop-by-hop headers, and those a `Connection` field names, never forwarded;
- `local_shortage`: a connection to a worker the router cannot open for want of its own
  descriptors or socket memory: its 503, nobody charged;
- `outcome`: what a forwarded request counts as (499, 502: `answer_code`) and whose fault its
  failures were (`charge`);
- `rank_refusal`: a worker refusing the dp rank the router told it, and the rank-less retry;
- `no_worker`: why a request has no worker to go to (the 503's message, the dry run's too);
- `pd`: the prefill/decode pair dispatcher (route a pair, send its two legs, retry), with
  `pair_hooks` (one attempt as its decode's answer sees it: both workers named, blame, the
  prefill's logprobs merged in), `pair_failure` (a pair's failures and how they are charged),
  `bootstrap_fields` (the bootstrap host, port and room an SGLang pair's legs get),
  `bootstrap_unreachable` (a decode that cannot reach its prefill's bootstrap server) and
  `kv_transfer_params` (what a vLLM pair's legs get, prefill first);
- `admin`: the `/admin` API (workers, namespaces, streams, route dry run, index dump/load);
- `dashboard/`: the live page at `/dashboard` (admin token), its login and the state it polls;
- `metrics`: the Prometheus metrics of one router;
- `holding`: the requests `policy.hold_until_room` holds, queued by the rank each waits for;
- `start_checks`: what a start refuses of a config, which a reload refuses alike;
- `keys`: the typed application keys naming the app's shared objects.

Nothing is imported here, so `kvroute --help` stays light.
"""
