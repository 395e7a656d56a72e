"""A DDP script forked by the zygote ends as soon as its ``main()`` returns.

``tests/scripts/ddp_end_race.py`` ends the way that deadlocks in torch's Gloo process group now
and then (about half of forked runs hung before workers kept their groups until exit, see
``zygote.keep_process_groups_until_exit``). Every run here must end; a hang is caught by the
per-run limit. ``KFP_ELASTIC_STRESS_RUNS`` sets the number of runs (CI runs a few).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_elastic.etcd.embedded import free_port
from kfp_elastic.rendezvous.warm_start import SHIM_PATH
from kfp_elastic.rendezvous.zygote import DEFAULT_PRELOAD
from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV
from tests.helpers import REPO_ROOT, running_zygote

PY = sys.executable
SCRIPT = REPO_ROOT / "tests" / "scripts" / "ddp_end_race.py"
RUNS = int(os.environ.get("KFP_ELASTIC_STRESS_RUNS", "4"))
HANG_S = 60  # a run that has not ended by then is hung (a run takes about a second)


@pytest.fixture(scope="module")
def torch_zygote(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zygote") / "sock")
    with running_zygote(path, DEFAULT_PRELOAD):
        yield path


def run_forked(socket_path: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, SOCKET_ENV: socket_path, "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = str(REPO_ROOT)
    with subprocess.Popen(
        [PY, "-S", SHIM_PATH, PY, "-u", str(SCRIPT)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as shim:
        try:
            output, _ = shim.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(shim.pid, signal.SIGKILL)  # the worker is in the shim's session too
            output, _ = shim.communicate()
            pytest.fail(f"a forked DDP worker did not end within {HANG_S}s:\n{output[-2000:]}")
        return subprocess.CompletedProcess(shim.args, shim.returncode, output)


def test_forked_ddp_workers_end_when_main_returns(torch_zygote, tmp_path) -> None:
    for run in range(RUNS):
        done = run_forked(torch_zygote, tmp_path)
        assert done.returncode == 0, f"run {run}: {done.stdout[-2000:]}"
        assert "ended" in done.stdout
