"""The `kvroute` command line: thin verbs over the packages that do the work.

- `cli`: the dispatcher behind the `kvroute` console script (the verb table);
- `serve`: `kvroute serve`, the router in front of an existing fleet;
- `up`: `kvroute up`, reference workers and the router in one command;
- `record`, `replay`: capture KV-event streams to a file, and play one back;
- `replicas`: `serve --processes N`, N children on one port; a reload one child is asked for
  reaches the others through the parent (`router.http.reload_link`, the line to each child).
- `shared_port`: the port those children share, refused when taken and held by the parent.
- `orphan`: a `--processes` child ends once its parent is gone, even if its own stop hangs.
- `hangup`: SIGHUP in a router process from its start to its exit, never its default action
  (which ends the process): held until the verb's handler is up, ignored once the loop is closed.
- `scratch`: the directory of `up --replicas` / `--relay` (the replicas' config, the JetStream
  store), which does not outlive `up`, not even a kill -9.

`kvroute worker` lives with the reference workers (`workers.command`), `kvroute bench` with the
benchmarks (`bench.command`). Nothing is imported here, so `kvroute --help` stays light.
"""
