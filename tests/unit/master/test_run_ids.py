"""A used run id: a new job under it is refused with what is there and what to do; a retry of
the same job (the KFP component's, same KFP run) still adopts it or returns its stored result;
``kfp-elastic forget`` frees the id."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import ProgressKeys
from kfp_elastic.job_spec import Entry, JobSpec, Policy
from kfp_elastic.master.job import ElasticJob
from kfp_elastic.master.state import MasterState, start_refusal
from tests.helpers import REPO_ROOT, master_command

KFP = "kfp-run:r"
FINISHED = {"state": "failed", "message": "bad model", "t": 1.0e9, "origin": KFP}
LEADER = {"id": "m-1", "host": "h", "pid": 7, "since": 1.0e9, "origin": KFP}


def test_a_new_job_under_a_finished_runs_id_is_refused() -> None:
    message = start_refusal("r", None, FINISHED, None, 40)
    assert message is not None
    assert message.startswith("run r already failed at 2001-09-09 01:46:40 UTC (bad model)")
    assert "--run-id" in message and "kfp-elastic forget r" in message
    other_kfp_run = start_refusal("r", "kfp-run:other", FINISHED, None, 40)
    assert other_kfp_run is not None and "already failed" in other_kfp_run


def test_a_retry_of_the_same_kfp_run_is_not_refused() -> None:
    assert start_refusal("r", KFP, FINISHED, None, 40) is None  # returns the stored result
    running = {**FINISHED, "state": "running"}
    assert start_refusal("r", KFP, running, LEADER, 40) is None  # waits for the old leader


def test_a_second_master_is_refused_unless_the_first_is_known_dead() -> None:
    message = start_refusal("r", None, {**FINISHED, "state": "running"}, LEADER, 3)
    assert message is not None
    assert message.startswith("run r has a live master: m-1 on host h (pid 7, since")
    assert "kfp-elastic forget r" in message
    # the same host's master died (SIGKILL): a restart waits for its lease and adopts
    assert start_refusal("r", None, {**FINISHED, "state": "running"}, LEADER, 3, True) is None
    # a restart of a running job whose master is gone adopts it, whoever starts it
    assert start_refusal("r", None, {**FINISHED, "state": "running"}, None, 3) is None


def test_progress_without_a_master_is_refused() -> None:
    message = start_refusal("r", None, None, None, 12)
    assert message is not None and "committed step 12" in message and "torchrun" in message
    assert start_refusal("r", None, None, None, None) is None  # a fresh run id


# -- against etcd ---------------------------------------------------------------------------------


def _spec(run_id: str) -> JobSpec:
    return JobSpec(run_id=run_id, entry=Entry(command=("train.py",)), policy=Policy(leader_ttl_s=2))


def _no_launcher(state: Any) -> Any:
    raise AssertionError("a refused job must not create a launcher")


def _finish(client: MultiEndpointEtcd3Client, spec: JobSpec, origin: str | None) -> None:
    state = MasterState(client, spec.run_prefix, lease_ttl=2, origin=origin)
    assert state.acquire(timeout=5)
    state.set_status("succeeded", "committed progress is complete")
    state.release()


def test_the_master_refuses_a_finished_run_and_a_retry_gets_its_result(
    client: MultiEndpointEtcd3Client, run_id: str
) -> None:
    spec = _spec(run_id)
    _finish(client, spec, "kfp-run:" + run_id)
    result = ElasticJob(spec, client, _no_launcher).run()
    assert (result.state, result.exit_code) == ("refused", 2)
    assert f"run {run_id} already succeeded" in result.message
    assert f"kfp-elastic forget {run_id}" in result.message
    assert MasterState(client, spec.run_prefix).status()["state"] == "succeeded"  # untouched
    retry = ElasticJob(spec, client, _no_launcher, origin="kfp-run:" + run_id).run()
    assert (retry.state, retry.message) == ("succeeded", "committed progress is complete")


def test_the_master_refuses_while_another_master_leads(
    client: MultiEndpointEtcd3Client, run_id: str
) -> None:
    spec = _spec(run_id)
    first = MasterState(client, spec.run_prefix, lease_ttl=2)
    assert first.acquire(timeout=5)
    try:
        result = ElasticJob(spec, client, _no_launcher).run()
    finally:
        first.release()
    assert result.state == "refused"
    assert f"run {run_id} has a live master: {first.identity}" in result.message


def test_forget_frees_the_run_id(client: MultiEndpointEtcd3Client, etcd: Any, run_id: str) -> None:
    spec = _spec(run_id)
    _finish(client, spec, None)
    client.put(ProgressKeys(spec.run_prefix).committed, "{}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "kfp_elastic", "forget", run_id, "--etcd", etcd.endpoint]
    holder = MasterState(client, spec.run_prefix, lease_ttl=2)
    assert holder.acquire(timeout=5)
    try:
        refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    finally:
        holder.release()
    assert refused.returncode == 2 and "has a live master" in refused.stderr
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"run {run_id}: deleted ")
    assert "(succeeded: committed progress is complete)" in done.stdout
    assert not list(client.get_prefix(spec.run_prefix + "/"))
    assert ElasticJob(spec, client, _no_launcher).state.refusal(run_id, None) is None


def test_kfp_elastic_master_refuses_a_used_run_id_before_its_checks(
    client: MultiEndpointEtcd3Client, etcd: Any, run_id: str, tmp_path: Any
) -> None:
    spec = _spec(run_id)
    _finish(client, spec, None)
    (tmp_path / "broken.py").write_text("def model(:\n")  # never loaded: the run id is refused
    command = master_command(
        run_id=run_id, etcd=etcd.endpoint, model_def="broken.py", workdir=str(tmp_path / "w")
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert f"kfp-elastic master: error: run {run_id} already succeeded at" in result.stderr
    assert f"kfp-elastic forget {run_id}" in result.stderr
    assert f"result=refused run={run_id} message=run {run_id} already succeeded" in result.stdout
    assert "SyntaxError" not in result.stderr
