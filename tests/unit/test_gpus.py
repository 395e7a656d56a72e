"""One placement rule for every local process: GPUs of its own, never shared by CUDA ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfp_elastic.gpus import GpuShortage, gpus_for_worker, require_gpus, visible_gpus
from kfp_elastic.testing import nodes as local_agents


def test_each_local_worker_gets_gpus_of_its_own(tmp_path: Path) -> None:
    gpus = ("0", "1", "2", "3")
    assert [gpus_for_worker(i, 1, gpus) for i in range(3)] == ["0", "1", "2"]
    assert gpus_for_worker(1, 2, gpus) == "2,3"  # LOCAL_RANK 0 and 1 of worker 1
    assert gpus_for_worker(2, 1, ("0", "1")) == "0"  # CPU processes only: they wrap
    assert gpus_for_worker(0, 1, ()) is None  # no GPU: the environment is left alone
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ("3", "5")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    for pci in ("0000:17:00.0", "0000:65:00.0"):  # what the NVIDIA driver lists, one per GPU
        (tmp_path / pci).mkdir()
    assert visible_gpus({}, tmp_path) == ("0", "1")
    assert visible_gpus({}, tmp_path / "no-driver", tmp_path / "no-dev") == ()
    dev = tmp_path / "dev"  # a sandbox without the driver's /proc entries: its device nodes
    dev.mkdir()
    for node in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (dev / node).touch()
    assert visible_gpus({}, tmp_path / "no-driver", dev) == ("0", "1", "2")


@pytest.mark.parametrize(
    ("device", "processes", "gpus", "refused"),
    [
        ("cuda", 3, ("0", "1"), True),
        ("cuda", 1, (), True),  # cuda without any GPU
        ("cuda", 2, ("0", "1"), False),
        ("auto", 3, ("0", "1"), True),  # auto would take the GPUs
        ("auto", 3, (), False),  # auto without GPUs: the CPU
        ("cpu", 3, ("0",), False),
        (None, 3, ("0",), False),  # a command of the user's: its device is unknown
    ],
)
def test_processes_on_gpus_never_outnumber_them(device, processes, gpus, refused) -> None:
    if refused:
        with pytest.raises(GpuShortage, match=f"{processes} processes need a GPU each"):
            require_gpus(device, processes, gpus)
    else:
        require_gpus(device, processes, gpus)


def test_the_local_harness_gives_each_node_its_gpus(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(local_agents, "visible_gpus", lambda: ("0", "1", "2"))
    monkeypatch.setattr(local_agents.Agent, "start", lambda agent: agent)  # no process
    group = local_agents.AgentGroup(tmp_path)
    common = {"backend": "c10d", "endpoint": "127.0.0.1:1", "run_id": "r"}
    first = group.start(device="cuda", **common)
    second = group.start(device="cuda", **common)
    assert (first.env["CUDA_VISIBLE_DEVICES"], second.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    given = group.start(env={"CUDA_VISIBLE_DEVICES": "2"}, **common)
    assert given.env["CUDA_VISIBLE_DEVICES"] == "2"  # the caller's choice stays
    with pytest.raises(GpuShortage, match="4 processes need a GPU each but this machine has 3"):
        group.start(device="cuda", **common)
