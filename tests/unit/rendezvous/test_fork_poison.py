"""A zygote never forks workers that cannot use CUDA.

torch marks every fork of a process that called the CUDA driver a "bad fork" (its first CUDA
call raises "Cannot re-initialize CUDA in forked subprocess"). This CPU-only build is never
poisoned, so poisoning is simulated by replacing torch.cuda's checks; tests/gpu/ has the real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kfp_elastic.rendezvous import zygote
from kfp_elastic.rendezvous.warm_start import SHIM_PATH
from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV
from tests.helpers import REPO_ROOT, wait_for

PY = sys.executable


@pytest.fixture
def clean_cuda(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """torch.cuda as on a GPU build whose process has not touched the driver."""
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(zygote, "nvml_loaded", lambda: False)
    return monkeypatch


def test_a_process_whose_forks_can_use_cuda_is_not_poisoned(clean_cuda) -> None:
    assert zygote.fork_poison() is None  # the probe child found no bad fork


def test_initialised_cuda_poisons_forks(clean_cuda) -> None:
    clean_cuda.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "initialised" in zygote.fork_poison(probe=False)


def test_nvml_loaded_in_the_agent_poisons_forks(clean_cuda) -> None:
    """torch's NVML-based is_available() leaves NVML initialised in the agent; a zygote forked
    from it must restart fresh, or NCCL fails in every worker."""
    clean_cuda.setattr(zygote, "nvml_loaded", lambda: True)
    assert "NVML is loaded" in zygote.fork_poison(probe=False)


def test_nvml_is_found_in_the_memory_map() -> None:
    assert zygote.nvml_loaded("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libnvidia-ml.so.580.159.04\n")
    assert not zygote.nvml_loaded("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n")
    assert not zygote.nvml_loaded()  # this machine has no NVIDIA driver; import torch loads none


def test_a_fork_of_a_poisoned_process_is_poisoned(clean_cuda) -> None:
    clean_cuda.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert "is a fork of one that called the CUDA driver" in zygote.fork_poison(probe=False)


def test_the_probe_fork_finds_a_driver_call_the_parent_cannot_see(clean_cuda) -> None:
    parent = os.getpid()
    # What torch's fork handler leaves after torch.cuda.is_available() here: only forks see it.
    clean_cuda.setattr(torch.cuda, "_is_in_bad_fork", lambda: os.getpid() != parent)
    assert zygote.fork_poison(probe=False) is None
    assert "a fork of it cannot use CUDA" in zygote.fork_poison()


def test_a_poisoned_zygote_refuses_every_request_with_its_reason() -> None:
    target, problem = zygote._validate(
        {"argv": [PY, "-u", "train.py"], "env": {}, "cwd": "/"}, [0, 1, 2], "CUDA is initialised"
    )
    assert target is None and problem == "CUDA is initialised"


WORKER = textwrap.dedent("""
    import json, os
    parent = open(f"/proc/{os.getppid()}/cmdline").read().split("\\0")
    print(json.dumps({"warm": os.environ.get("KFP_ELASTIC_WARM_STARTED"), "parent": parent}))
""")


def run_worker(socket_path: str, tmp_path: Path) -> tuple[dict, str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    shim = subprocess.run(
        [PY, "-S", SHIM_PATH, PY, "-u", str(script)],
        cwd=tmp_path,
        env={**os.environ, SOCKET_ENV: socket_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shim.returncode == 0, shim.stderr
    return json.loads(shim.stdout.splitlines()[0]), shim.stderr


def test_a_zygote_that_called_the_driver_starts_workers_cold(tmp_path: Path) -> None:
    path = str(tmp_path / "zygote.sock")
    # Poisoned after its preload, as a preload module calling torch.cuda.is_available() would.
    program = textwrap.dedent(f"""
        import os, subprocess, sys
        if len(sys.argv) == 1:
            sys.exit(subprocess.call([sys.executable, "-c", __PROGRAM__, str(os.getpid())]))
        import torch
        parent = os.getpid()
        torch.cuda._is_compiled = lambda: True
        torch.cuda._is_in_bad_fork = lambda: os.getpid() != parent
        from kfp_elastic.rendezvous import zygote
        zygote.main(["--socket", {path!r}, "--parent-pid", sys.argv[1], "--preload", "json"])
    """)
    program = program.replace("__PROGRAM__", repr(program))
    process = subprocess.Popen(
        [PY, "-c", program],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: os.path.exists(path), 60, what="the zygote's socket")
        info, shim_err = run_worker(path, tmp_path)
        assert info["warm"] is None, "a worker forked from a poisoned zygote cannot use CUDA"
        assert "a fork of it cannot use CUDA" in shim_err  # the shim says why it went cold
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        _, zygote_err = process.communicate()
    assert "warm start off, workers start cold" in zygote_err
