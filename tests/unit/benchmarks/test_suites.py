"""``python -m benchmarks``: every suite's ``--quick`` parses with its own parser, and ``--help``
lists the suites (nothing is measured here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import SUITES, suite_module
from benchmarks.__main__ import build_parser
from tests.helpers import REPO_ROOT


def test_the_suites() -> None:
    assert {"rendezvous", "runtime", "cluster", "chaos", "scheduling", "sharded"} <= set(SUITES)


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_quick_parses_and_bad_options_fail(suite: str) -> None:
    module = suite_module(suite)
    assert isinstance(module.build_parser(), type(build_parser()))
    args = module.parse_args(["--quick"])
    assert args.quick and args.out is None
    with pytest.raises(SystemExit) as exit:
        module.parse_args(["--no-such-option"])
    assert exit.value.code == 2


def test_quick_shortens_each_suite() -> None:
    assert suite_module("rendezvous").parse_args(["--quick"]).repeats == 1
    assert suite_module("rendezvous").parse_args(["--quick"]).sizes == [8]
    assert suite_module("runtime").parse_args(["--quick"]).repeats == 1
    assert suite_module("cluster").parse_args(["--quick"]).repeats == 1
    assert (
        suite_module("sharded").parse_args(["--quick"]).hidden
        < suite_module("sharded").parse_args([]).hidden
    )
    assert (
        suite_module("chaos").parse_args(["--quick"]).events
        < suite_module("chaos").parse_args([]).events
    )
    assert (
        suite_module("scheduling").parse_args(["--quick"]).jobs
        < suite_module("scheduling").parse_args([]).jobs
    )


def test_help_lists_every_suite_from_the_repository_root() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for suite in SUITES:
        assert f"  {suite} " in proc.stdout


def test_an_unknown_suite_is_refused_with_the_list() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "moon"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "invalid choice: 'moon'" in proc.stderr and "rendezvous" in proc.stderr
