"""kvroute's indexer: the wire protocol, the per-namespace prefix index and the subscribers.

- `engines`: one spec per inference engine (where the namespace lives on the wire, server-info
  discovery, chat convention, DP-rank requests); nothing else compares engine names;
- `protocol/`: wire model, decoder, encoder, frames, shared tokenizer;
- `namespace`: `Namespace` and the router's own block keys;
- `index/`: the pure prefix index (facade, per-stream tables, event writer, query walk,
  pending marks, namespace registry);
- `snapshot`: versioned dump/load of an index;
- `sequence`: the pure per-stream seq tracker (live subscriber and offline replayer);
- `fence`: the epoch fence, which proves a publisher's seq L is still the batch applied at L;
- `stream/`: `StreamSubscriber`, one ZMQ subscription per (worker, dp rank), one module per
  concept: gap repair, epoch proofs, refetches, restart candidates, live checks, the two
  sockets' disagreement, the window after a restart; `replay_client`: its replay DEALER;
- `sink`: where a subscriber's accepted batches go (`IndexSink`; `RecordingSink` in recording);
- `subscriptions`: the subscriber tasks of a process, by worker;
- `loop_watch`: whether the process's event loop ran lately (a stall may hide a restart);
- `health`: the stream health the per-worker answers read; `worker_matches`: those answers,
  with cached states (the service's query path);
- `service`: `IndexerService`, the router's API (re-exports the structs it uses);
- `shadowed`: prefixes sent with an `extra_key`, which their events show as plain;
  `server_stream`: what identifies a server's stream across worker ids and spellings, which
  parked shadows follow; `hosts`: which spellings of a host may name one machine;
- `config`, `stats`: the service's config and report structs;
- `recording/`: the recording format, capture (`kvroute record`), offline replay, republish;
- `fingerprint`: keyed fingerprints, the only way a salt or namespace is shown outside;
- `log_throttle`: a log line said at most once per interval per key, counting those held back;
- `backend`, `int_map`, `_intmap.c`, `_keychain.c`: the compiled core and its Python twins;
- `errors`: the indexer's error tree.
"""
