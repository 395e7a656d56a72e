"""Processes on GPUs: NCCL through the runtime's placement, one GPU per local process, and
workers forked by a zygote that can use CUDA whatever their agent asked the driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kfp_elastic.gpus import GpuShortage, gpus_for_worker, require_gpus, visible_gpus
from tests.gpu.support import GPU_COUNT, REPO_ROOT, python_env, requires_cuda, run_python
from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, requires_cuda]

RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from kfp_elastic.worker.device import init_process_group, place_this_process
    placement = place_this_process(sys.argv[1])
    init_process_group(placement, 60)
    value = torch.full((4,), float(dist.get_rank() + 1), device=placement.device)
    dist.all_reduce(value)
    print(json.dumps({"device": str(placement.device), "backend": placement.backend,
                      "sum": value[0].item(), "current": torch.cuda.current_device(),
                      "uuid": str(torch.cuda.get_device_properties(placement.device).uuid)}))
    dist.destroy_process_group()
""")


def test_nccl_ranks_on_their_own_gpus_reduce_together() -> None:
    world = min(2, GPU_COUNT)  # 2 processes where there are 2 GPUs, else a world of 1
    gpus = visible_gpus()
    results = run_ranks(
        RANK,
        "cuda",
        world=world,
        env_of=lambda rank: {
            "LOCAL_RANK": "0",  # each local node sees only its own GPU, as a pod does
            "CUDA_VISIBLE_DEVICES": gpus_for_worker(rank, 1, gpus) or "",
        },
    )
    assert {r["backend"] for r in results} == {"nccl"}
    assert all(r["device"] == "cuda:0" and r["current"] == 0 for r in results)
    assert {r["sum"] for r in results} == {world * (world + 1) / 2}
    assert len({r["uuid"] for r in results}) == world, "two ranks on one GPU"


def test_local_processes_never_outnumber_the_gpus() -> None:
    gpus = visible_gpus()
    assert len(gpus) == GPU_COUNT, "the driver's list and torch agree"
    with pytest.raises(GpuShortage, match=f"{GPU_COUNT + 1} processes need a GPU each"):
        require_gpus("cuda", GPU_COUNT + 1, gpus)
    require_gpus("cpu", GPU_COUNT + 1, gpus)


def test_auto_takes_the_gpu_and_says_so() -> None:
    code = "from kfp_elastic.worker.device import place_this_process as p; print(p('auto').device)"
    result = run_python(
        "import logging; logging.basicConfig(level=logging.INFO)\n" + code,
        env=python_env(LOCAL_RANK="0"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cuda:0"
    assert "device=cuda:0 (--device auto: torch sees" in result.stderr


# ---------------------------------------------------------------------------- fork safety

FORK = textwrap.dedent("""
    import os, sys, torch
    from kfp_elastic.rendezvous.zygote import fork_poison
    if sys.argv[1] == "launch-config":  # what torchrun does in every agent, --nproc-per-node 1 too
        from torch.distributed.launcher.api import LaunchConfig
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    else:
        torch.cuda.is_available()
    reason = fork_poison()
    pid = os.fork()
    if pid == 0:
        try:
            ok = (torch.ones(2, device="cuda") * 2).sum().item() == 4.0
        except Exception as error:
            print("child:", error, file=sys.stderr)
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    print({"reason": reason, "child_ok": os.waitstatus_to_exitcode(status) == 0})
""")


@pytest.mark.parametrize("ask", ["is-available", "launch-config"])
def test_the_fork_probe_tells_whether_a_forked_child_can_use_cuda(ask: str) -> None:
    env = python_env()
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    driver = run_python(FORK, ask, env=env)
    assert driver.returncode == 0, driver.stderr
    report = eval(driver.stdout)  # noqa: S307 - our own print of a dict
    assert report["child_ok"] is False and "cannot use CUDA" in report["reason"]
    nvml = run_python(FORK, ask, env=python_env(PYTORCH_NVML_BASED_CUDA_CHECK="1"))
    assert nvml.returncode == 0, nvml.stderr
    assert eval(nvml.stdout) == {"reason": None, "child_ok": True}  # noqa: S307


AGENT = textwrap.dedent("""
    import json, os, sys, torch
    torch.cuda.is_available()  # what torchrun's LaunchConfig does in an agent
    from kfp_elastic.rendezvous.warm_start import ZygoteProcess
    zygote = ZygoteProcess(["torch"])
    print(json.dumps({"socket": zygote.socket_path(fork_from_here=True)}), flush=True)
    sys.stdin.read()
    zygote.stop()
""")

WORKER = textwrap.dedent("""
    import json, os, torch
    value = (torch.ones(3, device="cuda") + 1).sum().item()
    print(json.dumps({"warm": os.environ.get("KFP_ELASTIC_WARM_STARTED"), "value": value}))
""")


@pytest.mark.parametrize("nvml_check", ["0", "1"])
def test_workers_of_a_zygote_use_cuda_whatever_the_agent_asked(nvml_check, tmp_path) -> None:
    from kfp_elastic.rendezvous.warm_start import SHIM_PATH
    from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV

    env = python_env()
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    if nvml_check == "1":
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        path = json.loads(agent.stdout.readline())["socket"]
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        started = time.monotonic()
        shim = subprocess.run(
            [sys.executable, "-S", SHIM_PATH, sys.executable, "-u", str(script)],
            cwd=tmp_path,
            env={**env, SOCKET_ENV: path},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert shim.returncode == 0, shim.stderr
        info = json.loads(shim.stdout.splitlines()[-1])
        assert info == {"warm": "1", "value": 6.0}, (info, time.monotonic() - started)
    finally:
        agent.stdin.close()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, 9)
            agent.wait()
    log = agent.stderr.read()
    if nvml_check == "0":
        assert "restarts as a fresh process" in log, log


def test_evaluate_runs_on_the_gpu_with_the_cpu_scores(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import json, sys, torch
        from kfp_elastic.worker.evaluate import evaluate
        from kfp_elastic.worker.model_def import load_model_def
        digits = "kfp_elastic.worker.examples.digits"
        torch.manual_seed(0)
        torch.save(load_model_def(digits).model().state_dict(), sys.argv[1])
        gpu, cpu = (evaluate(digits, sys.argv[1], device=d) for d in ("cuda", "cpu"))
        print(json.dumps({"same_accuracy": gpu.accuracy == cpu.accuracy,
                          "loss_gap": abs(gpu.loss - cpu.loss), "samples": gpu.samples}))
    """)
    result = run_python(code, str(tmp_path / "model.pt"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["same_accuracy"] and report["loss_gap"] < 1e-3 and report["samples"] > 0
