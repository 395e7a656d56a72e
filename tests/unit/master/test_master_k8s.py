"""ElasticJob with the Kubernetes launcher built by the CLI, against
testing/api_server.py: Pending
pods keep their slot, a preempted pod is replaced, pods gone while no master ran end as their
workers recorded (or unknown), succeeded pods end the job."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.client import connect
from kfp_elastic.master.cli import build_parser, make_spec, split_entry
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import JobDone, WorkerLaunched, WorkerLost, of_type, read_timeline
from kfp_elastic.master.wiring import launcher_factory
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.worker.ending import END_SIGTERM, WorkerEnd, record_end
from tests.helpers import wait_for

NS = "kfp-elastic"
UNSCHEDULABLE = [
    {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
]


@pytest.fixture
def k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespace=NS) as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            "users: [{name: fake, user: {}}]\n"
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        yield fake


def pods(fake: FakeKubernetes) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["status"].get("phase", "Pending") for p in fake.list(NS)["items"]
    }


def test_job_on_kubernetes_keeps_max_requested_and_replaces_preempted_pods(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str
) -> None:
    own, entry = split_entry(
        [
            "--run-id",
            run_id,
            "--etcd",
            etcd.endpoint,
            "--min-workers",
            "2",
            "--max-workers",
            "3",
            "--launcher",
            "kubernetes",
            "--image",
            "kfp-elastic-worker:0.1.0",
            "--namespace",
            NS,
            "--leader-ttl",
            "2",
            "--finish-grace",
            "5",
            "--",
            "--model-def",
            "m.py",
            "--snapshot-dir",  # the pods need one (the master's check refuses the job without)
            "/mnt/snap",
        ]
    )
    args = build_parser().parse_args(own)
    settings = etcd_settings.from_args(args, env={})
    spec = make_spec(args, entry, settings)
    assert spec.worker_argv() == (
        "-m",
        "kfp_elastic.worker",
        "--model-def",
        "m.py",
        "--snapshot-dir",
        "/mnt/snap",
    )
    client = connect(settings)
    job = ElasticJob(spec, client, launcher_factory(spec))
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()))
    thread.start()
    try:
        names = wait_for(
            lambda: (
                (len(pods(k8s)) == 3 and sorted(pods(k8s)))
                or (not thread.is_alive() and pytest.fail(f"job ended: {results}"))
            ),
            60,
            0.05,
            "3 pods",
        )
        assert names == [f"{run_id}-worker-{i}-0" for i in range(3)]
        pod = k8s.pod(names[0])
        assert pod["spec"]["priorityClassName"] == "kfp-elastic-worker-low"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["KFP_ELASTIC_ETCD_ENDPOINTS"] == etcd.endpoint
        k8s.set_phase(names[0], "Running")
        k8s.set_phase(names[1], "Running")
        k8s.set_phase(names[2], "Pending", conditions=UNSCHEDULABLE)
        time.sleep(1.5)
        assert len(pods(k8s)) == 3  # Pending keeps its slot; nothing extra is asked for

        k8s.preempt(names[1])
        replacement = f"{run_id}-worker-1-1"
        wait_for(lambda: replacement in pods(k8s), 30, 0.05, "replacement pod")
        assert len(pods(k8s)) == 3
        k8s.set_phase(replacement, "Running")
        k8s.set_phase(names[2], "Running")
        # The master steps down (its workers run on). While none runs, one pod is preempted
        # and gone, its worker having recorded the SIGTERM, and one vanishes without a word.
        job.request_stop(cancel=False)
        thread.join(30)
        assert results and results[0].state == "stepped_down", results
        end = WorkerEnd(END_SIGTERM, time.time(), 7, 2)
        record_end(client, spec.run_prefix, names[0], end)
        k8s.preempt(names[0])
        for name in (names[0], names[2]):
            if name in pods(k8s):
                k8s.remove_pod(NS, name)
        job = ElasticJob(spec, client, launcher_factory(spec))
        thread = threading.Thread(target=lambda: results.append(job.run()))
        thread.start()
        again = [f"{run_id}-worker-0-1", f"{run_id}-worker-2-1"]
        wait_for(lambda: set(again) <= set(pods(k8s)), 30, 0.05, "pods in their place")
        for name in (replacement, *again):
            k8s.set_phase(name, "Running")
            k8s.set_phase(name, "Succeeded", exit_code=0)
        thread.join(30)
        assert results[-1].state == "succeeded", results
        wait_for(lambda: not pods(k8s), 10, 0.05, "pods deleted")
    finally:
        job.request_stop(cancel=True)
        thread.join(30)
    timeline = read_timeline(client, spec.run_prefix)
    lost = [(e.name, e.cause, e.failure) for e in of_type(timeline, WorkerLost)]
    assert lost[0] == (names[1], "preempted", False)
    # Gone while no master watched: as the worker recorded it, else unknown (not invented).
    assert sorted(lost[1:]) == [(names[0], "preempted", False), (names[2], "unknown", False)]
    launched = [e.name for e in of_type(timeline, WorkerLaunched)]
    assert launched == [*names, replacement, *again]
    assert isinstance(timeline[-1], JobDone)
    state: Any = MasterState(client, spec.run_prefix)
    assert state.status()["state"] == "succeeded" and state.failures() == 0
    # A retried master names a new pod after every attempt in its table, gone ones too.
    retried = launcher_factory(spec)(state)
    try:
        assert retried.launch(1).name == f"{run_id}-worker-1-2"
    finally:
        retried.close()
    client.close()
