"""kvroute's indexer: the wire protocol, the per-namespace prefix index and the subscribers.

- `protocol/`: wire model, decoder, encoder, frames, shared tokenizer;
- `namespace`: `Namespace` and the router's own block keys;
- `index`: the pure prefix index; `walk`: its query pass; `pending`: pending entries;
- `registry`: namespace ids, codes, seeds and sizes; `worker_matches`: per-worker answers with
  cached stream states (the service's query path);
- `snapshot`: versioned dump/load of an index;
- `sequence`: the pure per-stream seq tracker (live subscriber and offline replayer);
- `subscriber`: one ZMQ subscription per (worker, dp rank), with gap repair;
- `service`: `IndexerService`, the router's API (re-exports the structs it uses);
- `config`, `stats`: the service's config and report structs;
- `recording`, `replayer`, `republisher`: the recording format and replay engines;
- `fingerprint`: keyed fingerprints, the only way a salt or namespace is shown outside;
- `errors`: the indexer's error tree.
"""
