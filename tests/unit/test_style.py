"""The tree is `ruff check` and `ruff format --check` clean (CI runs this as part of pytest)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff") or f"{sys.executable} -m ruff"
    return subprocess.run(
        [*ruff.split(), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", [("check", "."), ("format", "--check", ".")])
def test_ruff_is_clean(command: tuple[str, ...]) -> None:
    result = _ruff(*command)
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"


def test_fmt_skip_only_with_a_reason() -> None:
    """``# fmt: skip`` is allowed only under a comment line that says why."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    bare = []
    for path in tracked:
        lines = (REPO_ROOT / path).read_text().splitlines()
        for number, line in enumerate(lines, 1):
            reason_above = number > 1 and lines[number - 2].strip().startswith("#")
            if line.rstrip().endswith("# fmt: skip") and not reason_above:
                bare.append(f"{path}:{number}")
    assert not bare, f"# fmt: skip without a reason: {bare}"
