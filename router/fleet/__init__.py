"""The fleet behind the router: who its workers are, where their KV events come from, health.

- `supervisor`: pool membership (add, remove, registration with the indexer) and the health
  loop, the router's one background task;
- `discovery`: a worker's KV-event streams, from its config and its `/server_info`.

Nothing is imported here, so `kvroute --help` stays light.
"""
