"""`kvroute --help` stays light: the dispatcher imports only the verb on the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# what a help screen must not pay for: the HTTP stack, the benchmarks, ZMQ, template engines
HEAVY = ("aiohttp", "bench", "zmq", "jinja2", "transformers", "workers", "prometheus_client")

_PROBE = """
import json, sys
from router.commands.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})), file=sys.stderr)
"""


def _imported(*argv: str) -> tuple[str, set[str]]:
    # a fresh interpreter on the worktree's code: this process has imported everything already
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout, set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_top_level_help_lists_every_verb_and_imports_none_of_them() -> None:
    out, imported = _imported("--help")
    for verb in ("up", "serve", "worker", "record", "replay", "bench"):
        assert f"    {verb} " in out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_serve_help_defines_its_arguments_without_the_router() -> None:
    out, imported = _imported("serve", "--help")
    assert "--config" in out and "--policy" in out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_verb_still_gets_its_arguments() -> None:
    out, _ = _imported("record", "--help")
    assert "--endpoint" in out and "inspect" in out


def test_worker_and_up_help_show_the_defaults() -> None:
    # docs/workers.md sends readers to these screens for the defaults
    worker, _ = _imported("worker", "--help")
    assert "(block_size; default 16)" in worker and "default 30000" in worker
    assert "default tcp://127.0.0.1:5557" in worker
    up, _ = _imported("up", "--help")
    assert "(block_size; default 16)" in up and "(default 2)" in up
    words = " ".join(up.split())  # argparse wraps the help at the terminal's width
    # --prefill and --decode said none
    assert "default 0: no such fleet)" in words and "(with --prefill; default 0)" in words
    serve, _ = _imported("serve", "--help")
    assert "(default INFO)" in serve and "(default 1)" in serve


def test_record_and_replay_help_show_the_defaults_and_what_goes_together() -> None:
    """`--engine` had no help, `--worker`, `--duration` and replay's publish options showed no
    default, the usage's `ACTION ...` read as a required word, and inspect's help did not say
    that `--events` and `--json` are refused together."""
    record, _ = _imported("record", "--help")
    words = " ".join(record.split())  # argparse wraps the help at the terminal's width
    assert "ACTION" not in record
    assert "kvroute record (--config FILE | --endpoint tcp://HOST:PORT) --out FILE" in record
    assert "kvroute record inspect FILE [--events | --json]" in record
    assert "(default sglang)" in words and "(default worker)" in words
    assert "(default: none, until Ctrl-C, SIGTERM or SIGHUP)" in words
    inspect, _ = _imported("record", "inspect", "--help")
    assert inspect.startswith("usage: kvroute record inspect ")
    words = " ".join(inspect.split())
    assert "in order (not with --json)" in words and "JSON (not with --events" in words
    replay, _ = _imported("replay", "--help")
    words = " ".join(replay.split())
    for said in ("default 10000", "default 10)", "default 2)", "default 0)"):
        assert said in words, said


def _kvroute(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.commands.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("verb", ["serve", "indexer"])
def test_log_level_is_a_choice_in_any_case(tmp_path: Path, verb: str) -> None:
    missing = str(tmp_path / "nope.toml")
    refused = _kvroute(verb, "--config", missing, "--log-level", "bogus")
    assert refused.returncode == 2
    assert "argument --log-level: invalid choice" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    # lower case is accepted: the run gets as far as reading the (missing) config
    accepted = _kvroute(verb, "--config", missing, "--log-level", "debug")
    assert accepted.returncode == 2
    assert accepted.stderr.startswith(f"kvroute {verb}: {missing}"), accepted.stderr


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("serve", "--processes", "0"), "--processes"),
        (("serve", "--processes", "-1"), "--processes"),
        (("up", "--replicas", "0"), "--replicas"),
        (("up", "--workers", "0"), "--workers"),
        (("up", "--dp", "0"), "--dp-size/--dp"),
        (("up", "--prefill", "-1", "--decode", "1"), "--prefill"),
        (("up", "--prefill", "1", "--decode", "-1"), "--decode"),
        (("worker", "--dp-size", "-2"), "--dp-size/--dp"),
    ],
)
def test_counts_below_their_minimum_are_usage_errors_naming_the_flag(
    tmp_path: Path, argv: tuple[str, ...], flag: str
) -> None:
    # a missing config (and ephemeral ports) stop the verb early should argparse let one pass
    extra = {
        "serve": ("--config", str(tmp_path / "nope.toml")),
        "up": ("--config", str(tmp_path / "nope.toml"), "--worker-port-base", "0"),
        "worker": ("--port", "0", "--events", "tcp://127.0.0.1:0"),
    }[argv[0]]
    done = _kvroute(*argv, *extra)
    assert done.returncode == 2
    assert f"argument {flag}: must be at least" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--page-size", "0"), "page_size (--page-size): Expected `int` >= 1"),
        (("--time-scale", "-1"), "time_scale (--time-scale): Expected `float` >= 0.0"),
        (("--kv-transfer-timeout", "0"), "(--kv-transfer-timeout): Expected"),
    ],
)
def test_a_worker_value_out_of_range_names_its_option(argv: tuple[str, ...], said: str) -> None:
    done = _kvroute("worker", *argv, "--port", "0", "--events", "tcp://127.0.0.1:0")
    assert done.returncode == 2
    assert said in done.stderr, done.stderr
    assert "$." not in done.stderr  # msgspec's path to the field, which no user typed


def test_an_option_typed_wins_over_the_fleet_table_even_at_its_default() -> None:
    from router.commands.cli import build_parser
    from router.commands.up import _apply_fleet_table

    words = ["up", "--workers", "2", "--page-size", "16", "--time-scale=0"]
    parser, _ = build_parser(words)
    args = parser.parse_args(words)
    args.command_line = tuple(words)
    _apply_fleet_table(args, {"workers": 4, "page_size": 64, "dp_size": 2, "time_scale": 1.0})
    # typed (16 is --page-size's default, 2 is --workers'): kept; not typed: the table's
    assert (args.workers, args.page_size, args.time_scale, args.dp_size) == (2, 16, 0.0, 2)


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"workers": "two"}, "[fleet] workers: expected an integer"),
        ({"workers": 1.5}, "[fleet] workers: expected an integer"),
        ({"workers": True}, "[fleet] workers: expected a single value"),
        ({"workers": 0}, "[fleet] workers: must be at least 1"),
        ({"worker_port_base": "x"}, "[fleet] worker_port_base"),
    ],
)
def test_a_fleet_value_of_the_wrong_type_is_named_as_its_option_would_be(
    table: dict[str, object], said: str
) -> None:
    from router.commands.cli import build_parser
    from router.commands.up import _apply_fleet_table
    from router.errors import ConfigError

    parser, _ = build_parser(["up"])
    args = parser.parse_args(["up"])
    args.command_line = ("up",)
    with pytest.raises(ConfigError) as refused:
        _apply_fleet_table(args, table)
    assert said in str(refused.value)


@pytest.mark.parametrize(
    "verb", [("serve", "--config", "x.toml", "--port"), ("up", "--router-port")]
)
def test_a_port_past_65535_is_refused_by_name(verb: tuple[str, ...]) -> None:
    for port in ("65536", "99999", "-1", "http"):
        done = _kvroute(*verb, port)
        assert done.returncode == 2, done.stderr
        assert "port" in done.stderr and "Traceback" not in done.stderr


def test_relay_help_offers_no_option_the_relay_refuses_or_ignores() -> None:
    out, _ = _imported("relay", "--help")
    assert "--config" in out and "--port" in out
    # one process writes each stream once; it routes nothing, so no policy applies
    assert "--processes" not in out and "--policy" not in out
    done = _kvroute("relay", "--config", "x.toml", "--processes", "2")
    assert done.returncode == 2 and "usage: kvroute relay" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("verb", "needed"),
    [
        ("up", ()),
        ("serve", ("--config", "x.toml")),
        ("relay", ("--config", "x.toml")),
        ("worker", ()),
        ("replay", ("x.kvrec",)),
    ],
)
def test_an_unknown_option_is_refused_with_the_verbs_usage(
    verb: str, needed: tuple[str, ...]
) -> None:
    """Before, `kvroute up --bogus` printed `usage: kvroute [-h] VERB ...`: none of up's
    options."""
    done = _kvroute(verb, *needed, "--bogus", "x")
    assert done.returncode == 2
    assert f"usage: kvroute {verb} " in done.stderr, done.stderr
    assert "unrecognized arguments: --bogus x" in done.stderr, done.stderr


def test_a_fleet_value_refused_says_the_value_once() -> None:
    from router.commands.cli import build_parser
    from router.commands.up import _apply_fleet_table
    from router.errors import ConfigError

    parser, _ = build_parser(["up"])
    args = parser.parse_args(["up"])
    args.command_line = ("up",)
    for value in ("two", 2.5):
        with pytest.raises(ConfigError) as refused:
            _apply_fleet_table(args, {"workers": value})
        assert str(refused.value).count(str(value)) == 1, refused.value
