"""`kvroute serve` as a user runs it: a real process, a config file, Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp


async def _run(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "serve",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_serve_starts_answers_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[listen]\nport = 0\n[admin]\ntoken = "t"\n')
    proc = await _run("--config", str(config), "--policy", "round_robin")
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "listening on http://127.0.0.1:" in line and "round_robin" in line
        assert "index core native" in line or "index core python" in line
        url = line.split("listening on ")[1].split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                assert resp.status == 503  # no workers configured
            async with session.get(url + "/admin/workers") as resp:
                assert resp.status == 401
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text("[policy]\nnmae = 'kv'\n")
    proc = await _run("--config", str(config))
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"nmae" in err
