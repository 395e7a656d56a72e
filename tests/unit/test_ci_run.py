"""``.ci/run`` is README.md's test command in a fresh virtual environment of its own (running
it takes a full install: ``CI_PYTEST_ARGS='tests/unit/test_ci_run.py' .ci/run`` checks it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "run"


def _readme_test_command() -> list[str]:
    """The steps of README.md's second line (the test command), split at ``&&``."""
    line = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[1]
    assert line.endswith("python3 -m pytest -q -n 2"), line
    return [step.strip() for step in line.split("&&")]


def _script_lines() -> list[str]:
    return [line.strip() for line in SCRIPT.read_text().splitlines()]


def test_ci_runs_the_readme_test_command_step_by_step_in_order() -> None:
    lines = _script_lines()
    positions = [
        next(i for i, line in enumerate(lines) if line.startswith(step))
        for step in _readme_test_command()
    ]
    assert positions == sorted(positions)
    # One step per line: `set -e` stops at the first failing one (pytest's exit 5 included).
    assert "set -euo pipefail" in lines
    assert not any("||" in line or line.endswith("&& \\") for line in lines)


def test_ci_installs_into_a_fresh_venv_it_removes_afterwards() -> None:
    text = SCRIPT.read_text()
    venv = re.search(r'^venv="\$\(mktemp -d [^\n]+\)"$', text, re.MULTILINE)
    assert venv, "the venv lives in a new temporary directory"
    install = text.index("python3 -m pip install torch==2.13.0")
    for step in ('python3 -m venv "$venv"', 'source "$venv/bin/activate"', "trap 'rm -rf"):
        assert -1 < text.index(step) < install, step
    assert SCRIPT.stat().st_mode & 0o111, ".ci/run must be executable"
