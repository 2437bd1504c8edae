"""`kvroute bench SUITE --help` and the report option, alike across suites.

Routing and soak took `--out DIR`, the others `--output FILE`; no suite's help showed a
default (`--page-size PAGE_SIZE` with no word of 16), and decode and index wrote into the
installed repo's docs/benchmarks/ whatever the working directory, the others below it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.command import SUITES
from router.commands.cli import build_parser


def _suite_parser(suite: str) -> argparse.ArgumentParser:
    parser, _ = build_parser(["bench", suite])
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    suites = next(a for a in bench.choices["bench"]._actions if a.dest == "suite")
    chosen = suites.choices[suite]
    assert isinstance(chosen, argparse.ArgumentParser)
    return chosen


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_option_with_a_default_says_it_in_the_help(suite: str) -> None:
    parser = _suite_parser(suite)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        help_text = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in help_text, (action.option_strings, help_text)
        assert help_text in text, (action.option_strings, help_text)


@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("spelling", ["--out", "--output"])
def test_the_report_goes_where_out_or_output_says(suite: str, spelling: str) -> None:
    parser = _suite_parser(suite)
    report = next(a for a in parser._actions if {"--out", "--output"} & set(a.option_strings))
    args = parser.parse_args([spelling, "elsewhere"])
    assert str(getattr(args, report.dest)) == "elsewhere"
    assert {"--out", "--output"} <= set(report.option_strings), report.option_strings


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_report_defaults_below_the_working_directory(suite: str) -> None:
    parser = _suite_parser(suite)
    report = next(a for a in parser._actions if {"--out", "--output"} & set(a.option_strings))
    default = Path(report.default)
    assert not default.is_absolute() and default.parts[:2] == ("docs", "benchmarks"), default
