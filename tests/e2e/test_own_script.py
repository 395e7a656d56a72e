"""Bring your own script: a DDP script in the DDP tutorial's style run by ``kfp-elastic master``
and by the ``elastic_train`` component (kfp.local, local launcher). With the script API
(``tests/scripts/ddp_counting.py``) a preemption loses no step and every sample reaches the
final model once per epoch; a script using none of it (``tests/scripts/plain_ddp.py``) still
restarts after a node loss and resumes from its own checkpoint."""

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kfp_elastic.components.common import reap_local_processes
from kfp_elastic.etcd.client import connect
from kfp_elastic.master.state import MasterState
from kfp_elastic.worker.progress import Progress
from tests.helpers import REPO_ROOT, committed_step, master_command, sigkill_process_tree, wait_for

SCRIPTS = REPO_ROOT / "tests" / "scripts"
EPOCHS, SAMPLES = 2, 240


def stops_and_restores(logs: str) -> tuple[list[int], list[int]]:
    """Steps at which ranks stopped on SIGTERM, and steps that later worlds restored."""
    stops = [int(s) for s in re.findall(r"stopping on SIGTERM rank=\d+ step=(\d+)", logs)]
    restores = [int(s) for s in re.findall(r"restored rank=0 world=\d+ step=(\d+)", logs)]
    return stops, restores


def worker_logs(directory: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(directory.rglob("*.log")))


def assert_counted_once(model_file: Path) -> None:
    counts = torch.load(model_file, weights_only=True)["counts"]
    assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))


def test_own_script_through_the_master_loses_no_step_on_preemption(
    tmp_path: Path, etcd, run_id: str
) -> None:
    workdir = tmp_path / "work"
    command = master_command(
        ["-m", "tests.scripts.ddp_counting", "--samples", str(SAMPLES), "--step-time", "0.05"],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers=1,
        max_workers=2,
        max_wait=60,
        # Both workers in the first round (formed at once when both wait): the preemption
        # hits a training worker, never one still joining.
        rdzv_conf="last_call_timeout=30",
        workdir=workdir,
        dataset_length=SAMPLES,
        shard_size=20,
        epochs=EPOCHS,
        batch_size=4,
        snapshot_every=3,
        snapshot_dir=tmp_path / "snap",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    state = MasterState(client, f"/kfp-elastic/{run_id}")
    with open(tmp_path / "master.log", "wb") as log:
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: len(state.workers()) == 2, 60, 0.2, "two workers")
        wait_for(lambda: committed_step(progress) >= 6, 120, 0.2, "training under way")
        agent = next(r["pid"] for r in state.workers().values() if r.get("pid"))
        os.kill(agent, signal.SIGTERM)  # a preemption notice to one node
        assert master.wait(180) == 0, (tmp_path / "master.log").read_text()[-4000:]
        assert_counted_once(tmp_path / "snap" / "model.pt")
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch) == {"todo": 0, "doing": 0, "done": 12}
        stops, restores = stops_and_restores(worker_logs(workdir))
        assert stops, "no rank stopped on SIGTERM"
        # 0 steps lost: the next world starts at the very step every rank stopped at.
        assert set(stops) <= set(restores), (stops, restores)
    finally:
        with contextlib.suppress(ProcessLookupError):
            master.kill()
        master.wait(10)
        reap_local_processes(run_id)
        client.close()


def test_a_script_without_the_api_restarts_from_its_own_checkpoint(
    tmp_path: Path, etcd, run_id: str
) -> None:
    workdir = tmp_path / "work"
    command = master_command(
        [str(SCRIPTS / "plain_ddp.py"), "6", "1", "--batch_size", "16", "--step_time", "0.05"],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers=1,
        max_workers=2,
        max_wait=60,
        rdzv_conf="last_call_timeout=1",
        workdir=workdir,
        snapshot_dir=tmp_path / "snap",
    )
    client = connect(etcd.client_settings())
    state = MasterState(client, f"/kfp-elastic/{run_id}")
    with open(tmp_path / "master.log", "wb") as log:
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(state.workers()) == 2, 60, 0.2, "two workers")
        wait_for(
            lambda: "Training snapshot saved" in worker_logs(workdir), 120, 0.2, "a checkpoint"
        )
        agent = next(r["pid"] for r in state.workers().values() if r.get("pid"))
        sigkill_process_tree(agent)  # a node dies
        assert master.wait(180) == 0, (tmp_path / "master.log").read_text()[-4000:]
        logs = worker_logs(workdir)
        assert re.search(r"Resuming training from snapshot at Epoch [1-9]", logs), logs[-3000:]
        assert "Epoch 6 | Training snapshot saved" in logs
    finally:
        with contextlib.suppress(ProcessLookupError):
            master.kill()
        master.wait(10)
        reap_local_processes(run_id)
        client.close()


# ---------------------------------------------------------------- the component (kfp.local)


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings(
    "ignore:.*non-Python base image:RuntimeWarning",
    "ignore:.*have no effect in the current local runner",
)
def test_own_script_through_the_component_with_a_preemption(
    tmp_path: Path, session: str, capfd: pytest.CaptureFixture[str]
) -> None:
    from kfp import dsl, local

    from kfp_elastic.components.elastic_train.component import elastic_train
    from kfp_elastic.components.shard_dataset.component import shard_dataset

    torch.save(torch.zeros(SAMPLES, 1), tmp_path / "ids.pt")  # what shard_dataset counts

    @dsl.pipeline(name="own-script")
    def own_script(dataset: str, command: str) -> None:
        shards = shard_dataset(dataset=dataset, shard_size=20)
        elastic_train(
            shard_manifest=shards.outputs["manifest"],
            command=command,
            min_workers=2,  # both in the first round: the preemption hits a training worker
            max_workers=2,
            epochs=EPOCHS,
            batch_size=4,
            snapshot_every=3,
            launcher="local",
            inject_faults="preempt:worker-1@step6",
            max_wait_s=60.0,
        )

    root = tmp_path / "root"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    script = f"{SCRIPTS / 'ddp_counting.py'} --samples {SAMPLES} --step-time 0.05"
    own_script(dataset=str(tmp_path / "ids.pt"), command=script)
    log = capfd.readouterr().out
    (run,) = root.glob("own-script-*")
    assert "fault injected: preempt worker-1-0" in log, log[-4000:]
    (model,) = run.glob("elastic-train/model")
    assert_counted_once(model)
    stops, restores = stops_and_restores(worker_logs(run / "elastic-train"))
    assert stops and set(stops) <= set(restores), (stops, restores)


def test_the_docs_example_under_a_plain_torchrun(tmp_path: Path, etcd, run_id: str) -> None:
    """No master: torchrun's --rdzv-endpoint is all the script gets of etcd (the plugin hands it
    on); 49 samples leave one rank an empty last batch; scheduler and extras are snapshotted."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFP_ELASTIC_")}
    env.update(
        KFP_ELASTIC_SNAPSHOT_DIR=str(tmp_path / "snap"),
        KFP_ELASTIC_OUTPUT=str(tmp_path / "model.pt"),
        KFP_ELASTIC_EPOCHS="2",
        KFP_ELASTIC_BATCH_SIZE="4",
        KFP_ELASTIC_SNAPSHOT_EVERY="5",
        PYTHONPATH=str(REPO_ROOT),
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"),
        "--rdzv-backend=elastic-etcd",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1",
        str(SCRIPTS / "ddp_classifier.py"),
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    steps = 2 * 7  # 49 samples / global batch 8, twice
    assert f"trained steps={steps} lr_steps={steps}" in done.stdout, done.stdout
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())
    from kfp_elastic.worker.snapshot import Snapshotter

    (newest, *_) = Snapshotter(tmp_path / "snap").available()
    final = Snapshotter(tmp_path / "snap").load(newest)
    assert final["step"] == steps and final["epoch"] == 2
    assert final["scheduler"]["last_epoch"] == steps and final["extra"]["counter"]["steps"] == steps
