"""A command that must refuse at once: the shape every refusal test of the CLI checks."""

from __future__ import annotations

import asyncio
import sys

__all__ = ["refused_in_one_line"]


async def refused_in_one_line(verb: str, *args: str) -> str:
    """Run `kvroute VERB ARGS`, which must refuse: exit 2, nothing on stdout (nothing started,
    nor said), one line on stderr; returns that line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", verb, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = err.decode().splitlines()
    assert proc.returncode == 2 and not out, (out, lines[-3:])
    assert len(lines) == 1, lines[-3:]
    return lines[0]
