"""The soft descriptor limit is raised to the hard one when a verb starts: under the common soft
limit of 1,024 a router following a 100-rank worker capped its connections at 80."""

from __future__ import annotations

import asyncio
import os
import resource
import sys

import pytest

from router.commands.descriptor_limit import CEILING, raise_descriptor_limit


async def _limits_of_a_verb_started_under(soft: int, env: dict[str, str]) -> tuple[int, int]:
    """The descriptor limits of a process started under a soft limit of `soft` that ran a verb
    through the CLI's entry point (one that refuses its options at once: a `worker` whose
    replay host is not its events host)."""
    code = (
        "import resource, sys; from router.commands import cli; "
        "sys.argv = ['kvroute', 'worker', '--replay', 'tcp://127.0.0.2:5657']; "
        "import contextlib, io\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    assert cli.main() == 2\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    )

    def lower() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=env, preexec_fn=lower,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got_soft, got_hard = (int(word) for word in out.split())
    return got_soft, got_hard


async def test_a_verb_starts_with_its_soft_limit_raised_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip("the hard descriptor limit leaves nothing to raise")
    expected = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    env = dict(os.environ)
    env.pop("KVROUTE_RLIMIT_TUNING", None)
    assert await _limits_of_a_verb_started_under(1024, env) == (expected, hard)
    env["KVROUTE_RLIMIT_TUNING"] = "off"  # the operator's opt-out
    assert await _limits_of_a_verb_started_under(1024, env) == (1024, hard)


def test_a_limit_at_the_hard_one_is_left_alone() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else CEILING, hard)
        )
        assert raise_descriptor_limit({}) is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
