"""Several ranks of a process group as fresh Python processes on this machine: what the gloo
tests (``tests/helpers.run_gloo_ranks``) and the NCCL tests (``tests/gpu``) share. Standard
library only, so that the GPU tests can use it on a machine with nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str,
    *args: str,
    world: int = 2,
    timeout: float = 120,
    env_of: Callable[[int], Mapping[str, str]] = lambda rank: {},
) -> list[Any]:
    """Run ``python -c script *args`` as ``world`` ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT
    set, plus ``env_of(rank)``; the checkout first on PYTHONPATH) and return each rank's last
    stdout line as JSON, in rank order; a rank that fails fails the test with its stderr. Every
    rank is gone on return."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **env_of(rank),
        }
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        )
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", script, *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    reports = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=timeout)
            assert process.returncode == 0, err[-3000:]
            reports.append(json.loads(out.splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return reports
