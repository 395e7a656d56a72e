"""``kfp-elastic``: every subcommand answers ``--help`` with its own usage, and bad input fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kfp_elastic import cli


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
