"""The fleet behind the router: who its workers are, what they serve, where their KV events
come from, health.

- `supervisor`: the coordinator: pool membership (add, remove, discoveries in the background)
  and the health loop, the router's one background task;
- `registration`: registering a worker: its models, role and KV-event streams read, checked
  and subscribed with the indexer and the pool;
- `rereads`: a registered worker's settings and models read again, and the worker registered
  anew when they changed;
- `reread_schedule`: when a registered worker's settings are read again (a restart its
  streams saw, a STALE stream, mispredicted answers, the slow cadence), and how often settings
  that cannot be read are said;
- `registration_notes`: what the log says of each worker's registration (a refusal, a doubt,
  models named otherwise, a configured role the worker does not advertise, ambiguous adapters,
  a tokenizer that cannot be the router's), each once;
- `pd_sides`: a model served by one side of the prefill/decode pairs only, said once;
- `tokenizer_match`: whether the tokenizer a worker's server info says can be the router's;
- `discovery`: a worker's KV-event streams, from its config and its `/server_info`, and what
  its `/server_info` and `/v1/models` say it serves;
- `change`: whether a reload is changing the workers now, so a request it leaves briefly
  without a routable worker waits for the change's end instead of failing;
- `false_hits`: answers that keep reusing far less than predicted, the sign the router follows
  another process than the one behind a worker's URL;
- `false_hit_response`: what a streak of them does: the worker's streams subscribed anew, or,
  a streak again soon after, left unfollowed a while.

Nothing is imported here, so `kvroute --help` stays light.
"""
