"""`kvroute indexer --config FILE`: the KV index and its query API, without the proxy.

For a gateway that routes itself (an Envoy / Gateway API endpoint picker, another router) and
uses kvroute only as its KV index, as Dynamo's standalone indexer and llm-d's KV-cache manager
are used: the same config as `kvroute serve` (workers, tokenizer, policy for the scores), the
same subscribers and index, `POST /v1/kv/query`, `/metrics`, `/health`, the admin API and
reload; no generation endpoint.
"""

from __future__ import annotations

import argparse

from router.commands import serve

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute indexer` (those of `kvroute serve`; its --processes are one
    indexer, where the help said one router)."""
    serve.add_arguments(parser, runs="indexer")


def run(args: argparse.Namespace) -> int:
    """Load the config and serve the index until interrupted."""
    return serve.run(args, proxy=False)
