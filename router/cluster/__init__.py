"""Router replicas that agree: decisions, fleet and admin state, and warm starts on NATS.

Several router processes (on one host with SO_REUSEPORT, or on many) are one router when
they share a `[cluster]` (docs/router.md, "Replicas"). Each still builds its index from the
workers' events (derived state); what they share goes through NATS with JetStream:

- `wire`: the messages (decision batches, heartbeats, fleet, eviction and logout records);
- `outbox`: this replica's decisions, buffered on the request path and published in batches
  (the planner's `DecisionSink`);
- `peers`: the other replicas' decisions applied here (pending marks into the indexer, load
  into the load tracker per replica), and a replica's load dropped when its heartbeats stop;
- `fleet_state`: workers added, removed, drained, namespaces evicted and dashboard sessions
  logged out, in JetStream KV;
- `snapshots`: the index snapshot a new replica starts from (JetStream object store);
- `service`: `ClusterService`, the connection and its background tasks, owned by the app;
- `server`: a local `nats-server` process (tests, `kvroute up --replicas`, benchmarks);
- `nats_client`: the NATS client (no credentials in plain text to a `tls://` server), a closed
  one replaced, and one told to stop retrying;
- `tasks`: background tasks stopped within a bound (a cancellation nats-py's connect loop lost);
- `errors`: the error tree.

Nothing is imported here, so `kvroute --help` stays light.
"""
