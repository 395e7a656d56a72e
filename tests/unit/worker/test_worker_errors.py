"""Bad input to the worker runtime: a clear error, quickly, and nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kfp_elastic.contract.data_plan import shards_for_length
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import free_port
from kfp_elastic.worker.progress import Committed, Progress, manifest_from_shards
from tests.helpers import REPO_ROOT


def run_worker(
    etcd_endpoint: str, run_id: str, *worker_args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=elastic-etcd",
        f"--rdzv-endpoint={etcd_endpoint}",
        f"--rdzv-id={run_id}",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "-m",
        "kfp_elastic.worker",
        *worker_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COUNTING_SAMPLES": "40"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT
    )


def test_unknown_model_def_is_named(etcd, run_id: str, tmp_path: Path) -> None:
    result = run_worker(
        etcd.endpoint,
        run_id,
        "--model-def",
        "no_such.model_def",
        "--snapshot-dir",
        str(tmp_path),
        "--etcd",
        etcd.endpoint,
    )
    assert result.returncode != 0
    assert "--model-def no_such.model_def: module not found" in result.stdout + result.stderr


def test_unreachable_etcd_for_progress_is_named(etcd, run_id: str, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    result = run_worker(
        etcd.endpoint,
        run_id,
        "--model-def",
        "kfp_elastic.testing.model_defs.counting",
        "--snapshot-dir",
        str(tmp_path),
        "--etcd",
        dead,
        "--etcd-request-timeout",  # how long it tries is not what this test is about
        "1",
    )
    assert result.returncode != 0
    assert f"cannot use etcd at {dead}" in result.stdout + result.stderr


def _committed_with_snapshots(etcd, run_id: str, snap: Path, good: bool) -> Progress:
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    manifest = progress.publish_manifest(manifest_from_shards(shards_for_length(40, 10), epochs=1))
    snap.mkdir(parents=True, exist_ok=True)
    if good:  # an older, readable snapshot: step 1, nothing of epoch 0 consumed yet
        counts = torch.nn.Parameter(torch.zeros(40, dtype=torch.float64))
        optimizer = torch.optim.SGD([counts], lr=1.0)
        torch.save(
            {
                "model": {"counts": counts.detach()},
                "optimizer": optimizer.state_dict(),
                "step": 1,
                "epoch": 0,
                "position": 0,
                "rng": torch.get_rng_state(),
            },
            snap / "snapshot-000000001.pt",
        )
    (snap / "snapshot-000000002.pt").write_bytes(b"garbage, not a torch file")
    progress.commit(
        manifest, None, 0, Committed(step=2, epoch=0, position=16, snapshot="snapshot-000000002.pt")
    )
    return progress


def test_corrupt_snapshot_rolls_back_to_an_older_one(etcd, run_id: str, tmp_path: Path) -> None:
    progress = _committed_with_snapshots(etcd, run_id, tmp_path / "snap", good=True)
    result = run_worker(
        etcd.endpoint,
        run_id,
        "--model-def",
        "kfp_elastic.testing.model_defs.counting",
        "--snapshot-dir",
        str(tmp_path / "snap"),
        "--etcd",
        etcd.endpoint,
        "--batch-size",
        "8",
        "--output",
        str(tmp_path / "model.pt"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "snapshot-000000002.pt cannot be restored" in result.stderr
    counts = torch.load(tmp_path / "model.pt")["counts"]
    assert torch.equal(counts, torch.ones(40, dtype=torch.float64))  # no sample lost or doubled
    record, _ = progress.committed_record()
    assert record.complete


def test_corrupt_snapshot_without_fallback_stops_and_keeps_state(
    etcd, run_id: str, tmp_path: Path
) -> None:
    progress = _committed_with_snapshots(etcd, run_id, tmp_path / "snap", good=False)
    before = progress.committed_record()
    result = run_worker(
        etcd.endpoint,
        run_id,
        "--model-def",
        "kfp_elastic.testing.model_defs.counting",
        "--snapshot-dir",
        str(tmp_path / "snap"),
        "--etcd",
        etcd.endpoint,
    )
    assert result.returncode != 0
    assert "no older one is readable; nothing was overwritten" in result.stderr
    assert progress.committed_record() == before
    assert (tmp_path / "snap" / "snapshot-000000002.pt").read_bytes().startswith(b"garbage")


def test_bad_snapshot_schedule_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit code 2 and the flag's rule, before the model definition loads or etcd is asked (one
    case as a process, the others through the same entry point in this process)."""
    from kfp_elastic.worker.__main__ import main

    base = ["--model-def", "kfp_elastic.testing.model_defs.counting"]
    base += ["--snapshot-dir", str(tmp_path), "--etcd", "127.0.0.1:1"]
    result = subprocess.run(
        [sys.executable, "-m", "kfp_elastic.worker", *base, "--snapshot-every", "often"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "--snapshot-every must be a number" in result.stderr, result.stderr
    for bad, reason in (
        (["--snapshot-every", "-2"], "--snapshot-every must be >= 1, or 'auto'"),
        (["--snapshot-overhead", "1.5"], "--snapshot-overhead must be in (0, 1)"),
    ):
        assert main([*base, *bad]) == 2
        assert reason in capsys.readouterr().err


def test_a_wrong_command_line_reaches_the_master_through_the_error_file(tmp_path: Path) -> None:
    """argparse's error is recorded like any other (it used to exit without an error file: the
    master only learnt "the worker wrote no error file")."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from kfp_elastic.rendezvous.peer_failures import error_text

    error_file = tmp_path / "error.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfp_elastic.worker",
            "--model-def",
            "kfp_elastic.testing.model_defs.counting",
            "--snapshot-dir",
            str(tmp_path),
            "--etcd",
            "127.0.0.1:1",
            "--epochz",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "TORCHELASTIC_ERROR_FILE": str(error_file),
        },
    )
    assert result.returncode == 2
    assert "kfp-elastic worker: error: unrecognized arguments: --epochz 2" in result.stderr
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    text = error_text({0: failure})
    assert text.startswith("OptionsError: unrecognized arguments: --epochz 2 (rank 0, exit code 2)")
