"""The master with local workers: real etcd, real torchrun agents, a trivial worker entry.

Every test kills every process it started (found by the run id in their environment), also
when it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.failure_budget import read_failures
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.gpus import GpuShortage
from kfp_elastic.job_env import RUN_ID_ENV
from kfp_elastic.job_spec import (
    Data,
    Entry,
    JobSpec,
    KubernetesSettings,
    Launch,
    Policy,
    Size,
)
from kfp_elastic.master.cost import SlotUsage
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.launcher import Reason, WorkerPhase, WorkerStatus
from kfp_elastic.master.local_launcher import LocalLauncher
from kfp_elastic.master.metrics import TimelineStats
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import (
    Committed,
    EpochEnd,
    FailureCounted,
    JobDone,
    JobFailed,
    MasterRecovered,
    MasterStarted,
    RoundFormed,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
    WorkerRunning,
    of_type,
    read_timeline,
)
from kfp_elastic.processes import is_running, pids_with_env
from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE
from kfp_elastic.worker.progress import INITIAL, Progress
from tests.helpers import REPO_ROOT, WORKER_ENTRY, master_command, read_events, wait_for

ENTRY = str(WORKER_ENTRY)
RDZV = {"last_call_timeout": "0.5"}


def _pids_in_run(run_id: str) -> set[int]:
    return pids_with_env(RUN_ID_ENV, run_id)


@pytest.fixture
def reaper(run_id: str) -> Iterator[Callable[[subprocess.Popen[bytes]], None]]:
    """Kills every process of the run at the end (and processes handed to it)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs.append
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)
    for _ in range(3):
        for pid in _pids_in_run(run_id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    assert not [p for p in _pids_in_run(run_id) if is_running(p)]


def make_launcher(
    etcd: EmbeddedEtcd,
    run_id: str,
    workdir: Path,
    args: list[str],
    registry: Any = None,
    nnodes: tuple[int, int] = (1, 1),
    env_run_id: str | None = None,
    rdzv_conf: dict[str, str] = RDZV,
    **kwargs: Any,
) -> LocalLauncher:
    """``env_run_id``: the run id the reaper finds the processes by (default ``run_id``)."""
    env = {**etcd.client_settings().to_env(), "KFP_ELASTIC_RUN_ID": env_run_id or run_id}
    return LocalLauncher(
        run_id=run_id,
        endpoint=etcd.endpoint,
        min_workers=nnodes[0],
        max_workers=nnodes[1],
        entry=[ENTRY, "--state-dir", str(workdir), *args],
        workdir=workdir,
        rdzv_conf=rdzv_conf,
        env=env,
        registry=registry,
        grace_s=5.0,
        **kwargs,
    )


def ended(launcher: LocalLauncher, name: str, timeout: float = 30) -> WorkerStatus:
    return wait_for(
        lambda: next((s for s in launcher.list_workers() if s.name == name and s.ended), None),
        timeout,
        0.1,
        f"{name} ended",
    )


# --------------------------------------------------------------------------- launcher


def test_local_launcher_classifies_how_workers_end(
    etcd: EmbeddedEtcd, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    cases = {
        "ok": ["--steps", "0"],
        "crash": ["--exit-code", "3"],
        "preempt": ["--steps", "1000", "--events", str(tmp_path / "preempt.jsonl")],
        "kill": ["--steps", "1000", "--events", str(tmp_path / "kill.jsonl")],
        "delete": ["--steps", "1000", "--events", str(tmp_path / "delete.jsonl")],
        # No master holds this run's leadership: the agent stops itself after orphan_timeout.
        "orphaned": ["--steps", "1000"],
    }
    launchers = {
        case: make_launcher(
            etcd,
            f"{run_id}-{case}",
            tmp_path / case,
            args,
            env_run_id=run_id,
            max_restarts=0,
            rdzv_conf={**RDZV, "orphan_timeout": "0.5"} if case == "orphaned" else RDZV,
        )
        for case, args in cases.items()
    }
    names = {case: launcher.launch(0).name for case, launcher in launchers.items()}
    stop = threading.Event()
    seen: list[WorkerStatus] = []
    watcher = threading.Thread(target=lambda: seen.extend(launchers["delete"].events(stop)))
    watcher.start()
    try:
        for case in ("preempt", "kill", "delete"):
            wait_for(
                lambda c=case: read_events(tmp_path / f"{c}.jsonl"), 60, 0.1, f"{case} started"
            )
        launchers["preempt"].preempt(names["preempt"])
        launchers["kill"].kill(names["kill"])
        launchers["delete"].delete(names["delete"])

        ok = ended(launchers["ok"], names["ok"])
        assert (ok.phase, ok.reason, ok.exit_code) == (WorkerPhase.SUCCEEDED, Reason.COMPLETED, 0)
        crash = ended(launchers["crash"], names["crash"])
        assert (crash.phase, crash.reason) == (WorkerPhase.FAILED, Reason.ERROR)
        assert crash.exit_code == 1 and "exit code 1" in crash.message and crash.is_failure
        preempted = ended(launchers["preempt"], names["preempt"])
        assert preempted.reason == Reason.PREEMPTED and preempted.is_disruption
        # "preempted" alone when the agent outlived the grace period and the tree was killed
        assert "terminated by SIGTERM" in preempted.message or preempted.message == "preempted"
        killed = ended(launchers["kill"], names["kill"])
        assert killed.reason == Reason.PREEMPTED and "SIGKILL" in killed.message
        orphaned = ended(launchers["orphaned"], names["orphaned"])
        assert (orphaned.reason, orphaned.exit_code) == (Reason.ORPHANED, ORPHANED_EXIT_CODE)
        assert orphaned.is_disruption, orphaned
        wait_for(lambda: not launchers["delete"].list_workers(), 20, 0.1, "deleted worker gone")
        wait_for(lambda: seen and seen[-1].phase == WorkerPhase.DELETED, 5, 0.1, "Deleted event")
    finally:
        stop.set()
        watcher.join(5)
    assert [(e.phase, e.reason) for e in seen][0] == (WorkerPhase.RUNNING, None)
    assert (seen[-1].phase, seen[-1].reason) == (WorkerPhase.DELETED, Reason.DELETED)
    for case, launcher in launchers.items():
        assert not launcher.pids(names[case]), f"{case}: processes left"
        launcher.close()


def test_a_new_launcher_adopts_running_workers(
    etcd: EmbeddedEtcd, client: Any, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    state = MasterState(client, f"/kfp-elastic/{run_id}", lease_ttl=2)
    assert state.acquire(timeout=5)
    try:
        events = tmp_path / "events.jsonl"
        first = make_launcher(
            etcd, run_id, tmp_path, ["--steps", "1000", "--events", str(events)], registry=state
        )
        name = first.launch(0).name
        wait_for(lambda: read_events(events), 60, 0.1, "worker started")
        pid = first.worker_pid(name)
        assert state.workers()[name]["pid"] == pid and state.workers()[name]["tag"]

        # A new master's launcher; capacity 0: what it launches stays Pending (no process).
        second = make_launcher(etcd, run_id, tmp_path, [], registry=state, capacity=0)
        (status,) = second.list_workers()
        assert (status.name, status.phase, second.worker_pid(name)) == (
            name,
            WorkerPhase.RUNNING,
            pid,
        )
        assert second.launch(0).name == "worker-0-1"  # attempts continue, names never repeat
        second.delete("worker-0-1")
        second.preempt(name)
        status = ended(second, name)
        assert status.reason == Reason.PREEMPTED and "terminated by SIGTERM" in status.message
        second.close()
    finally:
        state.release()


# --------------------------------------------------------------------------- the job


def run_job(
    spec: JobSpec, client: MultiEndpointEtcd3Client, factory: Callable[..., Any], **kwargs: Any
) -> tuple[ElasticJob, threading.Thread, list[JobResult]]:
    job = ElasticJob(spec, client, factory, **kwargs)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()), daemon=True)
    thread.start()
    return job, thread, results


def parse_metrics(text: str) -> dict[str, float]:
    """``name{label="value",...}`` -> value, parsed by prometheus-client's own parser."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_job_replaces_a_killed_worker_and_succeeds(
    etcd: EmbeddedEtcd, client: Any, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    spec = JobSpec(
        run_id=run_id,
        size=Size(min_workers=2, max_workers=3),
        data=Data(dataset_length=320, shard_size=40, epochs=2),
        policy=Policy(max_wait_s=60, leader_ttl_s=2),
        launch=Launch(kubernetes=KubernetesSettings(on_demand_price=3.6, spot_price=1.8)),
        entry=Entry(
            command=(
                ENTRY,
                "--state-dir",
                str(tmp_path),
                "--steps",
                "40",
                "--step-time",
                "0.2",
                "--commit-every",
                "4",
            )
        ),
    )
    launchers: list[LocalLauncher] = []

    def factory(state: MasterState) -> LocalLauncher:
        launchers.append(
            make_launcher(
                etcd, run_id, tmp_path, list(spec.worker_argv()[1:]), registry=state, nnodes=(2, 3)
            )
        )
        return launchers[-1]

    job, thread, results = run_job(spec, client, factory, metrics_port=0, metrics_host="127.0.0.1")
    prefix = spec.run_prefix
    try:
        wait_for(
            lambda: [
                e for e in of_type(read_timeline(client, prefix), Committed) if e.world_size == 3
            ],
            90,
            0.2,
            "a commit of the 3-worker world",
        )
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{job.metrics.port}/metrics", timeout=5)
            .read()
            .decode()
        )
        metrics = parse_metrics(body)
        assert metrics["kfp_elastic_world_size"] == 3
        assert metrics['kfp_elastic_workers{phase="Running"}'] == 3
        assert metrics["kfp_elastic_committed_step"] >= 4
        assert 'kfp_elastic_shard_queue{epoch="1",state="todo"}' in metrics
        # Workers 0 and 1 guaranteed, 2 opportunistic: all three hold slots, priced per tier.
        assert metrics['kfp_elastic_slot_seconds_total{tier="guaranteed"}'] > 0
        assert metrics['kfp_elastic_slot_seconds_total{tier="opportunistic"}'] > 0
        assert metrics['kfp_elastic_cost{tier="opportunistic"}'] > 0
        victim = "worker-1-0"
        launchers[0].kill(victim)
        thread.join(120)
        assert results and results[0].state == "succeeded", results
    finally:
        job.request_stop(cancel=True)
        thread.join(30)
    timeline = read_timeline(client, prefix)
    lost = of_type(timeline, WorkerLost)
    assert (lost[0].name, lost[0].cause, lost[0].failure) == (victim, "preempted", False)
    # On a loaded machine the replacement may start after the others finished: it then finds
    # the run closed and exits 1, which is not counted as a failure.
    assert not [e for e in lost if e.failure]
    launched = [(e.index, e.attempt) for e in of_type(timeline, WorkerLaunched)]
    assert sorted(launched) == [(0, 0), (1, 0), (1, 1), (2, 0)]
    # The replacement joins a round of 3 again unless (a loaded machine) the run ended first.
    assert max(e.nodes for e in of_type(timeline, RoundFormed)) == 3
    assert of_type(timeline, Committed)[-1].complete is True
    assert [e.epoch for e in of_type(timeline, EpochEnd)] == [0, 1]
    assert isinstance(timeline[0], MasterStarted) and isinstance(timeline[-1], JobDone)
    running = {e.name for e in of_type(timeline, WorkerRunning)}
    assert running >= {"worker-0-0", "worker-1-0", "worker-2-0"}
    held = SlotUsage().add_all(timeline).slot_seconds()  # the job's end closed every slot
    assert held["guaranteed"] > held["opportunistic"] > 0
    state = MasterState(client, prefix)
    assert state.status()["state"] == "succeeded" and read_failures(client, prefix) == ()
    assert all(r.get("ended") for r in state.workers().values())


def test_master_sigkill_and_restart_keeps_the_workers(
    etcd: EmbeddedEtcd, client: Any, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    """While no master runs, the workers commit and one is preempted: the new master adopts
    the others, puts every commit on the timeline from the workers' records, reports the lost
    steps the commits show and records the preemption as such."""
    command = master_command(
        [
            ENTRY,
            "--state-dir",
            str(tmp_path),
            "--steps",
            "50",
            "--step-time",
            "0.2",
            "--commit-every",
            "5",
        ],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers="2",
        max_workers="2",
        leader_ttl="2",
        rdzv_conf="last_call_timeout=0.5",
        workdir=str(tmp_path / "work"),
        max_wait="60",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KFP_ELASTIC_RUN_ID": run_id}
    logs = [open(tmp_path / f"master{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    first = subprocess.Popen(command, stdout=logs[0], stderr=subprocess.STDOUT, env=env)
    reaper(first)
    prefix = f"/kfp-elastic/{run_id}"
    state = MasterState(client, prefix)
    progress = Progress(client, prefix)
    wait_for(lambda: of_type(read_timeline(client, prefix), Committed), 90, 0.2, "first commit")
    pids = {name: record["pid"] for name, record in state.workers().items()}
    assert len(pids) == 2
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    seen = of_type(read_timeline(client, prefix), Committed)[-1].step
    wait_for(
        lambda: (progress.committed_record()[0] or INITIAL).step >= seen + 10,
        60,
        0.1,
        "two commits while no master runs",
    )
    victim, survivor = sorted(pids)
    os.kill(pids[victim], signal.SIGTERM)  # its supervisor: like the kubelet's notice
    exit_file = Path(state.workers()[victim]["exit_file"])
    wait_for(exit_file.exists, 30, 0.1, "the preempted worker's end")
    second = subprocess.Popen(command, stdout=logs[1], stderr=subprocess.STDOUT, env=env)
    reaper(second)
    try:
        assert second.wait(120) == 0, (tmp_path / "master1.log").read_text()[-3000:]
    finally:
        for handle in logs:
            handle.close()
    timeline = read_timeline(client, prefix)
    assert len(of_type(timeline, MasterStarted)) == 1
    (recovered,) = of_type(timeline, MasterRecovered)
    assert list(recovered.workers) == sorted(pids)
    assert state.workers()[survivor]["pid"] == pids[survivor]  # adopted, not restarted
    assert [(e.name, e.cause) for e in of_type(timeline, WorkerLost)] == [(victim, "preempted")]
    # Every commit the workers made is on the timeline, also those no master saw ...
    committed, _ = progress.committed_record()
    assert committed is not None and committed.complete
    commits = [e.step for e in committed.recent]
    assert [e.step for e in of_type(timeline, Committed)] == commits
    # ... and the lost steps are what the commits show: none went back, and the world that
    # lost its worker stopped at a commit (SIGTERM), so 0.
    assert commits == sorted(commits)
    stats = TimelineStats().add_all(timeline)
    assert (stats.lost_steps, stats.goodput()) == (0, 1.0)
    assert of_type(timeline, WorkerCompleted) and isinstance(timeline[-1], JobDone)
    assert "result=succeeded" in (tmp_path / "master1.log").read_text()


def test_below_min_for_longer_than_max_wait_fails_with_a_clear_message(
    etcd: EmbeddedEtcd, client: Any, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    spec = JobSpec(
        run_id=run_id,
        size=Size(min_workers=2, max_workers=2),
        policy=Policy(max_wait_s=2, leader_ttl_s=2),
        entry=Entry(command=(ENTRY, "--state-dir", str(tmp_path), "--steps", "1000")),
    )

    def factory(state):
        return make_launcher(
            etcd,
            run_id,
            tmp_path,
            list(spec.worker_argv()[1:]),
            registry=state,
            nnodes=(2, 2),
            capacity=1,
        )

    job, thread, results = run_job(spec, client, factory)
    thread.join(60)
    assert results and results[0].state == "failed" and results[0].exit_code == 1
    message = results[0].message
    assert "only 1 of --min-workers=2 workers ran" in message and "--max-wait=2s" in message
    assert "worker-1-0 (Unschedulable: no free local slot (capacity 1))" in message
    timeline = read_timeline(client, spec.run_prefix)
    assert isinstance(timeline[-1], JobFailed) and timeline[-1].message == message
    assert MasterState(client, spec.run_prefix).status()["state"] == "failed"


def test_failing_workers_exhaust_the_failure_budget(
    etcd: EmbeddedEtcd, client: Any, tmp_path: Path, run_id: str, reaper: Any
) -> None:
    spec = JobSpec(
        run_id=run_id,
        size=Size(min_workers=1, max_workers=1),
        policy=Policy(max_failures=1, max_wait_s=60, leader_ttl_s=2),
        entry=Entry(command=(ENTRY, "--state-dir", str(tmp_path), "--exit-code", "3")),
    )

    def factory(state):
        return make_launcher(
            etcd,
            run_id,
            tmp_path,
            list(spec.worker_argv()[1:]),
            registry=state,
            max_restarts=0,
        )

    job, thread, results = run_job(spec, client, factory)
    thread.join(90)
    assert results and results[0].state == "failed" and results[0].failures == 2
    message = results[0].message
    assert message.startswith("2 worker failures exceed --max-failures=1; last: worker-0-1: ")
    assert "(rank 0, exit code 3)" in message  # the worker's own exit code, from its agent
    timeline = read_timeline(client, spec.run_prefix)
    lost = [(e.name, e.cause) for e in of_type(timeline, WorkerLost)]
    # The second agent's count spends the budget: the job may fail before its worker ends.
    assert lost in (
        [("worker-0-0", "failed")],
        [("worker-0-0", "failed"), ("worker-0-1", "failed")],
    )
    # Each counted once, by its agent (torchrun's --max-restarts=0: no restart in place).
    counted = of_type(timeline, FailureCounted)
    assert [(e.worker, e.source, e.count) for e in counted] == [
        ("worker-0-0", "agent", 1),
        ("worker-0-1", "agent", 2),
    ]


def test_min_above_max_is_refused_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfp_elastic.master",
            "--run-id",
            "x",
            "--etcd",
            "127.0.0.1:1",
            "--min-workers",
            "3",
            "--max-workers",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 2
    assert "max_workers (--max-workers / max_workers) must be >= min_workers=3, got 2" in (
        result.stderr
    )
    assert time.monotonic() - started < 10


def test_the_local_launcher_hands_each_worker_its_gpus(tmp_path: Path) -> None:
    def launcher(gpus: tuple[str, ...], device: str | None = None) -> LocalLauncher:
        return LocalLauncher(
            run_id="r",
            endpoint="127.0.0.1:2379",
            min_workers=1,
            max_workers=2,
            entry=["-m", "kfp_elastic.worker"],
            workdir=tmp_path,
            nproc_per_worker=2,
            gpus=gpus,
            device=device,
        )

    worker = launcher(("0", "1", "2", "3"))._new_worker("worker-1-0", 1, 0)
    assert worker.agent.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    cpu_only = launcher(())._new_worker("worker-1-0", 1, 0)
    assert cpu_only.agent.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    with pytest.raises(GpuShortage, match="4 processes need a GPU each but this machine has 3"):
        launcher(("0", "1", "2"), device="cuda")
    with pytest.raises(GpuShortage):
        launcher(("0", "1", "2"), device="auto")  # auto takes the GPUs it sees
    launcher(("0", "1", "2"), device="cpu")  # processes on the CPU need no GPU
