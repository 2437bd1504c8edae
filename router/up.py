"""`kvroute up`: the embedded fleet (reference workers + router) in one command."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute up`."""
    parser.add_argument("--workers", type=int, default=2, help="reference workers to start")


def run(args: argparse.Namespace) -> int:
    """Until the fleet lands: say what will be started."""
    print(f"kvroute up: would start {args.workers} reference workers and the router")
    return 0
