"""`kvroute up` as a new user runs it: workers + router, the printed curl works, Ctrl-C stops."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
from pathlib import Path

import aiohttp


async def _read_until(stream: asyncio.StreamReader, marker: str, lines: list[str]) -> str:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise AssertionError("kvroute up exited early:\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return line


async def test_up_starts_workers_and_router_and_its_curl_example_works() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "up",
        "--router-port",
        "0",
        "--worker-port-base",
        "0",
        "--time-scale",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        url = line.split("kvroute router:")[1].split()[0]
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C", lines), 10)
        start = next(i for i, text in enumerate(lines) if text.startswith("curl -s " + url))
        command = lines[start].rstrip().removesuffix("\\") + lines[start + 1].strip()
        if shutil.which("curl") and shutil.which("bash"):
            shell = await asyncio.create_subprocess_exec(
                "bash", "-c", command, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(shell.communicate(), 30)
            answer = json.loads(out)
        else:  # no curl here: send the very body the example shows
            body = command.split("-d '", 1)[1].rstrip("'")
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp,
            ):
                answer = await resp.json()
        assert answer["choices"][0]["message"]["content"]
        async with aiohttp.ClientSession() as session, session.get(url + "/admin/workers") as resp:
            workers = (await resp.json())["workers"]
        assert [w["id"] for w in workers] == ["worker-0", "worker-1"]
        assert all(w["status"] == "ready" and w["streams"] for w in workers)
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        assert b"stopped" in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_an_unknown_fleet_key_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "local.toml"
    config.write_text("[fleet]\nworkers = 1\npage_sise = 8\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "up",
        "--config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"page_sise" in err
