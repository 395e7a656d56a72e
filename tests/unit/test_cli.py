"""``kfp-elastic``: every subcommand answers ``--help`` with its own usage, and bad input fails."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kfp_elastic import cli
from tests.helpers import REPO_ROOT


def exit_code(argv: list[str]) -> int | str | None:
    """What ``kfp-elastic ARGV`` exits with (argparse's --help raises SystemExit; torchrun's
    ``@record`` turns that into a return)."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


# The agent runs torchrun in its own process below: in this one it would freeze pytest's objects.
@pytest.mark.parametrize("name", sorted(set(cli.SUBCOMMANDS) - {"agent"}))
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code([name, "--help"]) in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_the_agent_is_torchrun() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kfp_elastic.cli", "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--rdzv-backend" in done.stdout and "--nproc-per-node" in done.stdout


def test_overview_and_unknown_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    overview = capsys.readouterr().out
    assert all(name in overview for name in cli.SUBCOMMANDS)
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err


def test_the_testing_package_adds_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kfp-elastic demo`` comes from pyproject.toml's entry point, not from the console script
    (product code, which never names the testing package): installed as pip installs it, it
    answers ``--help`` and shows in the overview."""
    declared = re.search(
        r'^\[project\.entry-points\."kfp_elastic\.subcommands"\]\n(?P<body>(?:[^\[\n].*\n)+)',
        (REPO_ROOT / "pyproject.toml").read_text(),
        re.MULTILINE,
    )
    assert declared, "pyproject.toml declares no kfp_elastic.subcommands entry points"
    assert 'demo = "kfp_elastic.testing.demo"' in declared["body"]
    assert "demo" not in cli.SUBCOMMANDS
    dist = tmp_path / "added_subcommands-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: added-subcommands\nVersion: 0\n")
    points = declared["body"].replace('"', "")  # entry_points.txt as pip writes it
    (dist / "entry_points.txt").write_text(f"[{cli.ADDED_SUBCOMMANDS}]\n{points}")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.added_subcommands()["demo"].module == "kfp_elastic.testing.demo"
    assert exit_code(["demo", "--help"]) in (0, None)
    assert "usage: kfp-elastic demo" in capsys.readouterr().out
    assert cli.main([]) == 0
    assert "  demo " in capsys.readouterr().out


def test_an_added_subcommand_never_replaces_a_built_in_one() -> None:
    group = cli.ADDED_SUBCOMMANDS
    added = cli.added_subcommands(
        [
            EntryPoint("master", "kfp_elastic.testing.demo", group),
            EntryPoint("demo", "kfp_elastic.testing.demo", group),
        ]
    )
    assert list(added) == ["demo"]
    assert added["demo"].summary.startswith("Local demo:")
