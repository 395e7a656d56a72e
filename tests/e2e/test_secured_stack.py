"""The whole stack against an etcd with TLS, client certificates and user/password auth: the
master hands its etcd settings to every worker it starts (agents, the worker runtime), training
finishes with every sample seen exactly once, and the password is on no command line."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from kfp_elastic.components.common import reap_local_processes, run_pids
from kfp_elastic.etcd.client import connect
from kfp_elastic.master.timeline import EventKind, read_timeline
from kfp_elastic.pipelines.run_local import SESSION_ENV, artifact_metadata, outputs
from kfp_elastic.worker.progress import Progress
from tests.conftest import SecureEtcd
from tests.helpers import (
    REPO_ROOT,
    counting_worker_args,
    master_command,
    run_pipeline_locally,
    wait_for,
)

EPOCHS, SAMPLES, SHARD = 2, 160, 40
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*non-Python base image:RuntimeWarning",
    "ignore:.*have no effect in the current local runner",
)


def committed_step(progress: Progress) -> int:
    record, _ = progress.committed_record()
    return record.step if record else 0


def command_lines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return lines


@pytest.mark.timeout(240)
def test_master_with_local_workers_trains_exactly_once_on_a_secured_etcd(
    tmp_path: Path, secure_etcd: SecureEtcd, run_id: str
) -> None:
    etcd = secure_etcd.settings
    command = master_command(
        counting_worker_args(EPOCHS, tmp_path, "0.02"),
        # The connection as flags (the workers get it as KFP_ELASTIC_ETCD_* env).
        run_id=run_id,
        etcd=etcd.endpoint_text,
        etcd_cacert=str(etcd.cacert),
        etcd_cert=str(etcd.cert),
        etcd_key=str(etcd.key),
        etcd_user=str(etcd.user),
        etcd_password_file=str(etcd.password_file),
        min_workers="2",
        max_workers="2",
        max_wait="120",
        max_failures="0",
        rdzv_conf="last_call_timeout=1",
        workdir=str(tmp_path / "work"),
        dataset_length=str(SAMPLES),
        shard_size=str(SHARD),
        epochs=str(EPOCHS),
    )
    # Nothing of etcd's in the master's environment: all it knows comes from its flags.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFP_ELASTIC_ETCD_")}
    env.update(PYTHONPATH=str(REPO_ROOT), COUNTING_SAMPLES=str(SAMPLES), KFP_ELASTIC_RUN_ID=run_id)
    client = connect(etcd)
    progress = Progress(client, etcd.run_prefix(run_id))
    log_path = tmp_path / "master.log"
    with open(log_path, "wb") as log:
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(
            lambda: committed_step(progress) >= 3 or master.poll() is not None,
            120,
            0.2,
            "training under way",
        )
        assert master.poll() is None, log_path.read_text()[-4000:]
        lines = command_lines(sorted(run_pids(run_id)))
        assert lines and any("kfp_elastic.worker" in line for line in lines)
        assert not [line for line in lines if secure_etcd.password in line]
        assert master.wait(180) == 0, log_path.read_text()[-4000:]
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch) == {
                "todo": 0,
                "doing": 0,
                "done": SAMPLES // SHARD,
            }
        kinds = [event.kind for event in read_timeline(client, etcd.run_prefix(run_id))]
        assert kinds[-1] is EventKind.JOB_DONE
    finally:
        if master.poll() is None:
            master.kill()
        master.wait(10)
        reap_local_processes(run_id)
        client.close()


@pytest.mark.timeout(300)
def test_local_pipeline_trains_on_a_secured_etcd(
    tmp_path: Path,
    secure_etcd: SecureEtcd,
    session: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # What the kfp-elastic-config ConfigMap and the mounted Secrets give the task in a cluster.
    for name, value in secure_etcd.settings.to_env().items():
        monkeypatch.setenv(name, value)
    error, run = run_pipeline_locally(
        tmp_path, min_workers=2, max_workers=2, epochs=1, num_shards=8, snapshot_every=5
    )
    log = capfd.readouterr().out
    assert error is None, log[-5000:]
    assert "embedded etcd" not in log  # the job used the secured etcd
    assert "job succeeded" in log
    metrics = artifact_metadata(run / "elastic-train", "metrics")
    assert metrics["steps"] == 23  # 1437 samples / global batch 64, one epoch
    assert metrics["worker_failures"] == 0 and metrics["max_world_size"] == 2
    assert "model" in outputs(run)
    assert not run_pids(session, SESSION_ENV)
    # The exit handler deleted the finished run's keys through the same secured connection.
    deleted = re.search(r"stop_workers: deleted (\d+) etcd keys of (\S+)", log)
    assert deleted and int(deleted[1]) > 0, log[-3000:]
    client = connect(secure_etcd.settings)
    try:
        assert not list(client.get_prefix(secure_etcd.settings.run_prefix(deleted[2]) + "/"))
    finally:
        client.close()
