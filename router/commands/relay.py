"""`kvroute relay --config FILE`: the workers' KV events, repaired and proven, into JetStream.

One relay for the fleet (or one per group of workers, each with its own config) subscribes to
the workers' ZMQ streams as a router does (gap repair, epoch fence, restart detection, the
same index), and writes everything its index takes to the JetStream stream
`<prefix>_events` of the config's [cluster]. Replicas with `[cluster] events = "relay"` follow
that stream instead of subscribing to every worker themselves. It serves `/health` (with a
`relay` section), `/metrics`, the admin API and `POST /v1/kv/query` like `kvroute indexer`;
SIGHUP reloads the config. See docs/router.md, "The event relay".
"""

from __future__ import annotations

import argparse

from router.commands import serve

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute relay`: those of `kvroute serve` but --processes (the streams'
    records are numbered by one process: two would write each stream twice) and --policy (it
    routes nothing: no policy applies)."""
    serve.add_arguments(parser, routes=False, processes=False)


def run(args: argparse.Namespace) -> int:
    """Load the config and relay until interrupted."""
    return serve.run(args, proxy=False, relay=True)
