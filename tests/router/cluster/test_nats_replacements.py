"""A NATS client closed for good is replaced after a pause that doubles while the new clients
close before doing their work; each reason is said once an incident (`Replacements`)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from router.cluster.nats_client import Replacements


def _closed_with(error: Exception | None) -> NATS:
    nc = NATS()
    nc._err = error  # what nats-py keeps as `last_error` when it closes the client
    return nc


def test_each_reason_is_said_once_an_incident_and_again_after_the_client_worked() -> None:
    said = Replacements()
    refused = _closed_with(ConnectionError("maximum control line exceeded"))
    assert said.closed(refused) == "ConnectionError: maximum control line exceeded"
    assert said.closed(refused) is None  # the same incident: said already
    assert said.closed(_closed_with(None)) == ""  # another reason (none kept): said
    said.worked()
    assert said.closed(refused) == "ConnectionError: maximum control line exceeded"


async def test_the_pause_doubles_up_to_its_cap_and_starts_over_once_a_client_worked() -> None:
    replacements = Replacements(first_s=0.001, longest_s=0.003)
    pauses = []
    for _ in range(4):
        pauses.append(replacements.pause_s)
        await replacements.pause()
    assert pauses == [0.001, 0.002, 0.003, 0.003]
    replacements.worked()
    assert replacements.pause_s == 0.001
    started = asyncio.get_running_loop().time()
    await replacements.pause()
    assert asyncio.get_running_loop().time() - started >= 0.001
