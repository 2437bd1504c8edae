"""`kvroute bench tokenize`: does tokenizing long prompts on a thread pay? (issue 14)

A Hugging Face `tokenizer.json` encode of a ~5,000-token prompt costs milliseconds of CPU on
the router's event loop. `tokenizers` releases the GIL in `encode_batch` (not in `encode`), so
`tokenizer.offload_min_bytes` parses long bodies on a thread (`router.prompt.offload`). This
measures, on this machine:

- the encode itself: `encode` and `encode_batch` of one long prompt, and how far a second thread
  (standing in for the event loop) gets while a thread encodes, as a share of its pace alone;
- a real `kvroute serve` (HF tokenizer, default `kv` policy) in front of a trivial backend under
  a mixed load: `--long-clients` clients sending long completion prompts and `--short-clients`
  clients sending tiny ones, for `--seconds` per round; long prompts/s, short requests/s and
  the short requests' latency, with the encode on the loop (`offload_min_bytes = 0`) and on a
  thread (`offload_min_bytes = --min-bytes`), rounds interleaved so drift hits both alike.

The tokenizer is a byte-level BPE (32k vocabulary) trained at start on deterministic synthetic
text: real tokenizers differ, so measure yours. Report: `docs/benchmarks/tokenize.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec

from bench.command import write_markdown
from bench.proxy_bench import _pct, _process, _router_cmd

__all__ = ["add_arguments", "run"]

_WORDS = 20_000
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench tokenize`."""
    parser.add_argument("--prompt-words", type=int, default=3000, help="words per long prompt")
    parser.add_argument("--long-clients", type=int, default=4)
    parser.add_argument("--short-clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=8192, help="offload threshold tried")
    parser.add_argument("--threads", default="1,2", help="offload thread counts tried (csv)")
    parser.add_argument("--output", "--out", default="docs/benchmarks/tokenize.md")


def _words(rng: random.Random) -> list[str]:
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(_WORDS)]


def _train(path: Path) -> None:
    """A byte-level BPE with a 32k vocabulary, trained on synthetic text (deterministic)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = _words(rng)
    corpus = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(3000)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=32_000, initial_alphabet=alphabet)
    )
    tok.save(str(path))


def _prompts(n: int, words: int) -> list[str]:
    """Long prompts: words both from the training text and not (a real prompt's mix)."""
    rng = random.Random(1)
    known = _words(random.Random(0))
    out = []
    for _ in range(n):
        parts = [
            rng.choice(known)
            if rng.random() < 0.7
            else "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9)))
            for _ in range(words)
        ]
        out.append(" ".join(parts))
    return out


def _pace(seconds: float) -> int:
    count = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count


def _spin(call: Callable[[], object], stop: threading.Event) -> None:
    while not stop.is_set():
        call()


def _encode_rows(path: Path, prompt: str) -> list[str]:
    """Cost of one encode, and the GIL share a second thread keeps while a thread encodes."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    tokens = len(tok.encode(prompt, add_special_tokens=False).ids)
    rows = []
    calls: dict[str, Callable[[], object]] = {
        "encode": lambda: tok.encode(prompt, add_special_tokens=False),
        "encode_batch": lambda: tok.encode_batch([prompt], add_special_tokens=False),
    }
    for name, call in calls.items():
        times = []
        for _ in range(30):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        alone = _pace(0.5)
        stop = threading.Event()
        thread = threading.Thread(target=_spin, args=(call, stop))
        thread.start()
        beside = _pace(0.5)
        stop.set()
        thread.join()
        rows.append(
            f"| `{name}` | {tokens:,} | {statistics.median(times) * 1e3:.2f} | "
            f"{min(times) * 1e3:.2f} | {beside / alone:.2f} |"
        )
    return rows


class _Mixed(msgspec.Struct):
    long_done: int = 0
    short_done: int = 0
    errors: int = 0
    seconds: float = 0.0
    short_lat: list[float] = msgspec.field(default_factory=list)


async def _mixed(url: str, prompts: list[str], args: argparse.Namespace, into: _Mixed) -> None:
    bodies = [msgspec.json.encode({"model": "m", "prompt": p, "max_tokens": 1}) for p in prompts]
    short = msgspec.json.encode({"model": "m", "prompt": "hi", "max_tokens": 1})
    headers = {"Content-Type": "application/json"}
    stop = time.monotonic() + args.seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(body: bytes) -> bool:
            try:
                async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        async def long_client(i: int) -> None:
            n = i
            while time.monotonic() < stop:
                ok = await post(bodies[n % len(bodies)])
                n += args.long_clients
                into.long_done += ok
                into.errors += not ok

        async def short_client() -> None:
            while time.monotonic() < stop:
                started = time.perf_counter()
                ok = await post(short)
                if ok:
                    into.short_lat.append(time.perf_counter() - started)
                    into.short_done += 1
                else:
                    into.errors += 1

        started = time.perf_counter()
        await asyncio.gather(
            *(long_client(i) for i in range(args.long_clients)),
            *(short_client() for _ in range(args.short_clients)),
        )
        into.seconds += time.perf_counter() - started


async def _run(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        started = time.perf_counter()
        _train(path)
        trained_s = time.perf_counter() - started
        prompts = _prompts(8, args.prompt_words)
        encode_rows = _encode_rows(path, prompts[0])
        body_bytes = len(msgspec.json.encode({"model": "m", "prompt": prompts[0]}))
        modes: dict[str, tuple[int, int]] = {"on the loop (offload_min_bytes = 0)": (0, 1)}
        for threads in (int(n) for n in str(args.threads).split(",")):
            name = f"on {threads} thread(s) (offload_min_bytes = {args.min_bytes})"
            modes[name] = (args.min_bytes, threads)
        results = {name: _Mixed() for name in modes}
        long_only = {name: _Mixed() for name in modes}
        alone = argparse.Namespace(**{**vars(args), "short_clients": 0})
        async with _process("python3", "-m", "bench.proxy_bench", "backend") as backend:
            configs = {}
            for name, (min_bytes, threads) in modes.items():
                config = Path(tmp) / f"router-{min_bytes}-{threads}.toml"
                config.write_text(
                    '[listen]\nhost = "127.0.0.1"\nport = 0\n[admin]\nenabled = false\n'
                    f'[tokenizer]\nkind = "hf"\npath = "{path}"\nchat_template = "kvroute"\n'
                    f"offload_min_bytes = {min_bytes}\noffload_threads = {threads}\n"
                    f'[[workers]]\nid = "backend"\nurl = "{backend}"\nkv_events = false\n'
                )
                configs[name] = config
            for _ in range(args.rounds):
                for name, config in configs.items():
                    async with _process(*_router_cmd(config)) as router:
                        warm = argparse.Namespace(**{**vars(args), "seconds": 1.0})
                        await _mixed(router, prompts, warm, _Mixed())
                        await _mixed(router, prompts, args, results[name])
                        await _mixed(router, prompts, alone, long_only[name])
    rows = []
    for name, r in results.items():
        lat = r.short_lat or [0.0]
        rows.append(
            f"| {name} | {r.long_done / r.seconds:,.1f} | {r.short_done / r.seconds:,.0f} | "
            f"{_pct(lat, 0.5) * 1e3:.2f} | {_pct(lat, 0.99) * 1e3:.2f} | {r.errors} |"
        )
    for name, r in long_only.items():
        rows.append(
            f"| {name}, long prompts only | {r.long_done / r.seconds:,.1f} | - | - | - | "
            f"{r.errors} |"
        )
    load = os.getloadavg()
    return "\n".join(
        [
            "# Tokenizing long prompts off the event loop",
            "",
            "Written by `kvroute bench tokenize` (module docstring: `bench/tokenize_bench.py`). "
            "The tokenizer is a byte-level BPE with a 32k vocabulary trained for the run on "
            f"synthetic text ({trained_s:.1f} s); real tokenizers differ, measure yours.",
            "",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end of the run (timings on a "
            "shared machine are noisy).",
            "",
            "## One long prompt",
            "",
            "`beside` is how far a second Python thread gets while a thread runs the call in a "
            "loop, as a share of its pace alone (1.00: the call holds no GIL; near 0: it "
            "holds it throughout).",
            "",
            "| call | tokens | median ms | min ms | beside |",
            "|---|---|---|---|---|",
            *encode_rows,
            "",
            "## A router under mixed load",
            "",
            f"`kvroute serve` (tokenizer kind `hf`, policy `kv`) in front of a trivial backend; "
            f"{args.long_clients} clients send long completion prompts ({body_bytes:,}-byte "
            f"bodies, {len(prompts)} distinct prompts) while {args.short_clients} clients send "
            f'tiny ones (prompt "hi"), {args.rounds} interleaved rounds of {args.seconds:g} s '
            "per mode; then the long clients alone for as long. The load generator, the "
            "backend and the router share the CPUs.",
            "",
            "| encode | long prompts/s | short req/s | short p50 ms | short p99 ms | errors |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def run(args: argparse.Namespace) -> int:
    """Run the tokenize benchmark and write its report."""
    report = asyncio.run(_run(args))
    write_markdown(report, args.output)
    return 0
