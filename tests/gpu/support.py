"""What the GPU tests share: the skip when there is no CUDA GPU, and fresh Python processes.

Whether CUDA is there is asked through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``): asking the
CUDA driver would make every fork of the test process a "bad fork", which is what some of these
tests look for. Only the repository and torch are needed (no etcd, no Kubernetes client), so
``pytest tests/gpu --confcutdir=tests/gpu`` runs them on a machine that has nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
import torch  # noqa: E402 - after the variable: torch.cuda reads it when asked

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0


def python_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh Python process that imports this checkout."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_python(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` in a fresh process (its CUDA state its own)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=env or python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
