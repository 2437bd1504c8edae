"""Recording KV-event streams and playing them back.

- `format`: the versioned, appendable, crash-safe recording file (`RecordingWriter`,
  `RecordingReader`, `Record`, `Source`);
- `capture`: `kvroute record`'s engine: subscriptions that sink into a recording, repairing and
  proving streams exactly as the router's indexer does;
- `replay`: a recording applied offline into an index, walking the live subscriber's decisions;
  record selection by time or seq window;
- `republish`: a recording put back on PUB sockets (with a replay ROUTER) at recorded pace,
  with optional fault injection.

Nothing is imported here: import the module you need (`from indexer.recording.format import
RecordingWriter`).
"""
