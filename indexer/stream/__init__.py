"""One stream's subscriber: a ZMQ subscription per (worker, dp rank), its gaps repaired, its
publisher's restarts proven, the index kept in sync.

- `subscriber`: `StreamSubscriber`, its task and session loop (the SUB, its monitor, the idle
  wait), the live path through the `SequenceTracker`, a batch applied or fetched again, its
  stats;
- `state`: `SubscriberState`, every attribute the parts share, the pieces they all use (the
  log, the state shown, a clear, the replay DEALER), and what one part calls of another;
- `restart_candidates`: signs that the publisher may have restarted (a dropped connection, an
  unanswered replay, `suspect_restart`) and their proof against its fence;
- `replay_answers`: a replay answer read onto the stream, held to the epoch fence;
- `repair`: gaps repaired, idle probes, and the catch-up of a stream rebuilt from its
  publisher's buffer;
- `live_checks`: live batches asked of the replay socket though they follow on in seq;
- `disagreement`: a replay socket trusted, found out as another publisher's, or disagreeing
  with the event socket about the publisher;
- `restarts`: a restart found, and the window after it, when the dead process's batches may
  still arrive.

Sequence tracking, the epoch fence, refetches and restart candidates are one state machine over
one stream: its state is one object's (`SubscriberState`), each concept a mixin over it, and
`StreamSubscriber` combines them. It was one module (`indexer/subscriber.py`) until it grew
past 2,500 lines; its log lines are the logger `indexer.stream`'s (they were
`indexer.subscriber`'s). The socket work that is not a decision lives in
`indexer.replay_client` and `indexer.sink`.
"""
