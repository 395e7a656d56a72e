"""ElasticJob with the Kubernetes launcher built by the CLI, against
testing/api_server.py: Pending
pods keep their slot, a preempted pod is replaced, pods gone while no master ran end as their
workers recorded (or unknown), succeeded pods end the job."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.contract.failure_budget import read_failures
from kfp_elastic.contract.worker_end import END_SIGTERM, WorkerEnd, record_end
from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_spec import DEFAULT_GUARANTEED_PRIORITY_CLASS as GUARANTEED
from kfp_elastic.job_spec import DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS as OPPORTUNISTIC
from kfp_elastic.job_spec import JobSpec
from kfp_elastic.master.cli import build_parser, make_spec, split_entry
from kfp_elastic.master.host import make_launcher, plan, prestart_checks
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.preflight import PreflightError, ladder_classes_problem
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import (
    JobDone,
    JobFailed,
    LadderMoved,
    ModelDefChecked,
    WorkerLaunched,
    WorkerLost,
    of_type,
    read_timeline,
)
from kfp_elastic.master.wiring import cluster_priority_value
from kfp_elastic.testing.api_server import FakeKubernetes
from tests.helpers import wait_for

NS = "kfp-elastic"
MASTER_SPEC = {"containers": [{"name": "main", "image": "kfp-elastic:0.1.0"}]}
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
    """The worker pods' phases (not the master's own pod, where a test creates one)."""
    return {
        p["metadata"]["name"]: p["status"].get("phase", "Pending")
        for p in fake.list(NS)["items"]
        if p["metadata"]["name"] != "master"
    }


def test_job_on_kubernetes_keeps_max_requested_and_replaces_preempted_pods(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The master runs in pod "master": the job's Events are about that pod.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KFP_POD_NAME", "master")
    master_pod = k8s.create(NS, {"metadata": {"name": "master"}, "spec": MASTER_SPEC})
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
    job = ElasticJob(spec, client, partial(make_launcher, plan(spec)))
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
        # MIN=2: workers 0 and 1 are guaranteed, worker 2 opportunistic
        classes = [k8s.pod(n)["spec"]["priorityClassName"] for n in names]
        assert classes == [GUARANTEED, GUARANTEED, OPPORTUNISTIC]
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
        # a lost guaranteed worker's replacement takes its slot, so it is guaranteed again
        assert k8s.pod(replacement)["spec"]["priorityClassName"] == GUARANTEED
        k8s.set_phase(replacement, "Running")
        k8s.set_phase(names[2], "Running")
        # The replacement is launched as soon as the preemption is announced (DisruptionTarget);
        # the end is recorded when the pod is gone: this master records it before stepping down.
        wait_for(
            lambda: any(
                e.name == names[1]
                for e in of_type(read_timeline(client, spec.run_prefix), WorkerLost)
            ),
            30,
            0.05,
            "the preempted worker's end recorded",
        )
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
        job = ElasticJob(spec, client, partial(make_launcher, plan(spec)))
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
    assert state.status()["state"] == "succeeded" and read_failures(client, spec.run_prefix) == ()
    # Each master recorded its decisions as Kubernetes Events about the pods concerned.
    recorded = [
        (e["involvedObject"]["name"], e["reason"], e["message"])
        for e in k8s.events(ns=NS)
        if e["source"]["component"] == "kfp-elastic-master"
    ]
    created = [(n, "SuccessfulCreate") for n in names]
    assert [r[:2] for r in recorded if r[1] == "SuccessfulCreate"] == created, recorded
    replaced = {r[0]: r[2] for r in recorded if r[1] == "WorkerReplaced"}
    assert replaced[replacement].endswith(f"to replace {names[1]} (preempted)"), recorded
    assert replaced[again[0]].endswith(f"to replace {names[0]} (preempted)"), recorded
    assert replaced[again[1]].endswith(f"to replace {names[2]} (unknown)"), recorded
    lost = {r[0]: r[2] for r in recorded if r[1] == "WorkerLost"}
    assert set(lost) == {names[0], names[1], names[2]}, recorded
    assert recorded[-1][:2] == ("master", "JobSucceeded"), recorded
    uid = master_pod["metadata"]["uid"]
    assert all(
        e["involvedObject"]["uid"] == uid
        for e in k8s.events("master", ns=NS)
        if e["source"]["component"] == "kfp-elastic-master"
    )
    # A retried master names a new pod after every attempt in its table, gone ones too.
    retried = make_launcher(plan(spec), state)
    try:
        assert retried.launch(1).name == f"{run_id}-worker-1-2"
    finally:
        retried.close()
    client.close()


def start_job(run_id: str, etcd: EmbeddedEtcd, workers: int) -> tuple[Any, ElasticJob]:
    own, entry = split_entry(
        ["--run-id", run_id, "--etcd", etcd.endpoint, "--min-workers", str(workers)]
        + ["--max-workers", str(workers), "--launcher", "kubernetes", "--namespace", NS]
        + ["--image", "kfp-elastic-worker:0.1.0", "--leader-ttl", "2", "--finish-grace", "5"]
        + ["--", "--model-def", "m.py", "--snapshot-dir", "/mnt/snap"]
    )
    args = build_parser().parse_args(own)
    settings = etcd_settings.from_args(args, env={})
    spec = make_spec(args, entry, settings)
    return connect(settings), ElasticJob(
        spec, connect(settings), partial(make_launcher, plan(spec))
    )


@pytest.mark.parametrize("verb", ["create", "list", "watch"])
def test_a_role_missing_a_verb_fails_the_job_at_once_saying_what_to_grant(
    k8s: FakeKubernetes,
    etcd: EmbeddedEtcd,
    run_id: str,
    tmp_path: Path,
    monkeypatch: Any,
    verb: str,
) -> None:
    sa = "kfp-elastic-master"
    verbs = [v for v in ("create", "list", "watch", "delete") if v != verb]
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": verbs}
    k8s.create_object("roles", NS, {"metadata": {"name": sa}, "rules": [rule]})
    k8s.create_object(
        "rolebindings",
        NS,
        {
            "metadata": {"name": sa},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa}],
        },
    )
    kubeconfig = tmp_path / "sa-kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{k8s.url}'}}}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
        f"users: [{{name: fake, user: {{token: {k8s.service_account_token(NS, sa)}}}}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    client, job = start_job(run_id, etcd, 2)
    try:
        result = job.run()  # returns: no retrying a refused call
    finally:
        client.close()
    assert result.state == "failed", result
    assert result.message.startswith(
        f"the master's service account (system:serviceaccount:{NS}:{sa}) may not {verb} pods in "
        f"namespace {NS}: grant verb '{verb}' on 'pods' in its Role (manifests/base/rbac.yaml"
    ), result.message
    assert not pods(k8s)  # none made, or the ones made deleted again


def test_pod_changes_while_watches_expire_and_history_compacts_are_all_seen(
    etcd: EmbeddedEtcd, run_id: str, tmp_path: Path, monkeypatch: Any
) -> None:
    # Watches cut every 0.3 s, history older than 1 s compacted, bookmarks every 0.1 s.
    with FakeKubernetes(namespace=NS, watch_timeout_s=0.3, compaction_s=1.0, bookmark_s=0.1) as k8s:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{k8s.url}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            "users: [{name: fake, user: {}}]\n"
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        client, job = start_job(run_id, etcd, 2)
        results: list[JobResult] = []
        thread = threading.Thread(target=lambda: results.append(job.run()))
        thread.start()
        try:
            first = wait_for(lambda: len(pods(k8s)) == 2 and sorted(pods(k8s)), 60, 0.05, "2 pods")
            for name in first:
                k8s.set_phase(name, "Running")
            wait_for(lambda: job.launcher.watch_count >= 3, 30, 0.05, "watches cut and resumed")
            # The watch is down while a worker is deleted and that history is compacted: the
            # reconnect gets 410, lists again, and the worker's loss is still noticed.
            k8s.hold_watches()
            k8s.close_watches()
            k8s.delete(NS, first[0])
            k8s.compact()
            k8s.release_watches()
            replacement = first[0][: -len("-0")] + "-1"
            wait_for(lambda: replacement in pods(k8s), 30, 0.05, "replacement pod")
            lists = job.launcher.list_count
            assert lists >= 2  # the 410 made it list again
            k8s.set_phase(replacement, "Running")
            for name in (first[1], replacement):
                k8s.set_phase(name, "Succeeded", exit_code=0)
            thread.join(30)
            assert results and results[0].state == "succeeded", results
        finally:
            job.request_stop(cancel=True)
            thread.join(30)
        timeline = read_timeline(client, job.spec.run_prefix)
        client.close()
    lost = [(e.name, e.cause) for e in of_type(timeline, WorkerLost)]
    assert lost == [(first[0], "deleted_externally")], lost
    assert [e.name for e in of_type(timeline, WorkerLaunched)] == [*first, replacement]


LADDER = "kfp-elastic-worker-level-0,kfp-elastic-worker-level-1,kfp-elastic-worker-level-2"


def k8s_job(
    run_id: str, etcd: EmbeddedEtcd, *master: str, model: str = "m.py", snap: str = "/mnt/snap"
) -> tuple[Any, JobSpec, ElasticJob]:
    """Min 2, max 3 worker pods; ``master``: more of the master's flags."""
    own, entry = split_entry(
        ["--run-id", run_id, "--etcd", etcd.endpoint, "--min-workers", "2"]
        + ["--max-workers", "3", "--launcher", "kubernetes", "--namespace", NS]
        + ["--image", "kfp-elastic-worker:0.1.0", "--leader-ttl", "2", "--finish-grace", "5"]
        + [*master, "--", "--model-def", model, "--snapshot-dir", snap]
    )
    args = build_parser().parse_args(own)
    settings = etcd_settings.from_args(args, env={})
    spec = make_spec(args, entry, settings)
    return (
        connect(settings),
        spec,
        ElasticJob(spec, connect(settings), partial(make_launcher, plan(spec))),
    )


def ladder_job(run_id: str, etcd: EmbeddedEtcd) -> tuple[Any, JobSpec, ElasticJob]:
    """On the manifests' three-level ladder compressed in time: a pod without a GPU counts as
    one, so three Running pods pass 0.36 GPU-seconds within a second."""
    return k8s_job(
        run_id,
        etcd,
        *("--ladder-priority-classes", LADDER, "--ladder-thresholds", "0.0001,0.002"),
        *("--ladder-min-move-interval", "1", "--ladder-starvation", "30"),
    )


def classes(fake: FakeKubernetes) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"]["priorityClassName"] for p in fake.list(NS)["items"]}


def test_a_job_moves_down_the_ladder_re_creating_its_guaranteed_workers_in_each_level(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str
) -> None:
    levels = LADDER.split(",")
    client, spec, job = ladder_job(run_id, etcd)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()))
    thread.start()
    try:
        first = [f"{run_id}-worker-{i}-0" for i in range(3)]
        wait_for(lambda: set(first) <= set(pods(k8s)), 30, 0.05, "3 pods")
        # Level 0 for the guaranteed slots, the opportunistic class for the others
        assert [classes(k8s)[n] for n in first] == [levels[0], levels[0], OPPORTUNISTIC]

        def run_all() -> None:
            for name, phase in pods(k8s).items():
                if phase == "Pending":
                    k8s.set_phase(name, "Running")

        def at_level(level: int) -> bool:
            run_all()
            now = classes(k8s)
            guaranteed = [n for n in now if "-worker-0-" in n or "-worker-1-" in n]
            return len(guaranteed) == 2 and all(now[n] == levels[level] for n in guaranteed)

        # Demoted twice (0.36 and 7.2 GPU-seconds): each move re-creates workers 0 and 1
        wait_for(lambda: at_level(2), 60, 0.1, "the guaranteed workers at level 2")
        assert classes(k8s)[first[2]] == OPPORTUNISTIC  # never moved
        state = MasterState(client, spec.run_prefix)
        assert state.ladder()["level"] == 2
        assert job.metrics.snapshot.ladder_level == 2
        assert job.metrics.snapshot.attained_gpu_seconds > 0.36
        timeline = read_timeline(client, spec.run_prefix)
        moves = [(e.from_level, e.level, e.action) for e in of_type(timeline, LadderMoved)]
        assert moves[-1][1] == 2 and all(action == "demote" for *_, action in moves)
        assert [m[1] for m in moves] == sorted(m[1] for m in moves)  # only down
        lost = {e.name: e.cause for e in of_type(timeline, WorkerLost)}
        assert lost[first[0]] == lost[first[1]] == "deleted" and first[2] not in lost
        # A new master goes on from the stored level: no move back, no pod re-created
        job.request_stop(cancel=False)
        thread.join(30)
        assert results[-1].state == "stepped_down", results
        before = classes(k8s)
        client2, _, job = ladder_job(run_id, etcd)
        thread = threading.Thread(target=lambda: results.append(job.run()))
        thread.start()
        wait_for(lambda: job._ladder is not None and job.launcher is not None, 30, 0.05, "led")
        time.sleep(1.5)
        assert job._ladder.level == 2 and classes(k8s) == before
        client2.close()
    finally:
        job.request_stop(cancel=True)
        thread.join(30)
        client.close()


def test_a_ladder_the_cluster_cannot_honour_is_refused_before_any_worker(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str
) -> None:
    _, spec, _ = ladder_job(run_id, etcd)
    k8s_settings = spec.launch.kubernetes.resolved({})
    assert ladder_classes_problem(k8s_settings, cluster_priority_value) is None
    k8s.delete_object("priorityclasses", "", "kfp-elastic-worker-level-2")
    problem = ladder_classes_problem(k8s_settings, cluster_priority_value)
    assert problem and "'kfp-elastic-worker-level-2'" in problem and "ladder" in problem
    k8s.create_object(
        "priorityclasses",
        "",
        {"metadata": {"name": "kfp-elastic-worker-level-2"}, "value": -1, "preemptionPolicy": ""},
    )
    problem = ladder_classes_problem(k8s_settings, cluster_priority_value)
    assert problem and "level 1" in problem and "level 2" in problem
    with pytest.raises(PreflightError, match="level 1"):
        prestart_checks(plan(spec))
    assert pods(k8s) == {}


def gated_model_def(path: Path, gate: Path, body: str) -> Path:
    """A model definition whose import waits until ``gate`` exists, then runs ``body``: the
    check's load stays in progress as long as the test wants."""
    path.write_text(
        "import pathlib, time\n"
        f"while not pathlib.Path({str(gate)!r}).exists():\n"
        "    time.sleep(0.05)\n" + body
    )
    return path


def run_checked_job(
    run_id: str, etcd: EmbeddedEtcd, model: Path, tmp_path: Path
) -> tuple[ElasticJob, threading.Thread, list[JobResult], Any]:
    """The job as the host runs it: its checks (``prestart_checks``) as its ``prepare``."""
    _, spec, _ = k8s_job(run_id, etcd, model=str(model), snap=str(tmp_path / "snap"))
    launch = plan(spec, files_here=True)
    client = connect(spec.etcd)
    job = ElasticJob(
        spec,
        client,
        partial(make_launcher, launch),
        prepare=lambda state: prestart_checks(launch, adopting=bool(state.workers())),
    )
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()))
    thread.start()
    return job, thread, results, client


def test_worker_pods_are_created_while_the_model_definition_is_checked_and_deleted_if_it_fails(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    """The check loads the model definition (seconds: torch) while the master creates the
    pods; its failure fails the job with its message and deletes them."""
    gate = tmp_path / "gate"
    model = gated_model_def(
        tmp_path / "broken_model.py", gate, "raise RuntimeError('broken on purpose')\n"
    )
    job, thread, results, client = run_checked_job(run_id, etcd, model, tmp_path)
    try:
        # the pods exist while the check still waits at the gate
        wait_for(lambda: len(pods(k8s)) == 3, 30, 0.05, "pods created during the check")
        assert not results
        gate.write_text("")
        thread.join(60)
        assert results and results[0].state == "failed", results
        assert "broken on purpose" in results[0].message
        assert "model_def" in results[0].message
        wait_for(lambda: not pods(k8s), 30, 0.05, "the pods deleted")
        events = read_timeline(client, f"/kfp-elastic/{run_id}")
        (checked,) = of_type(events, ModelDefChecked)
        (failed,) = of_type(events, JobFailed)
        assert not checked.passed and "broken on purpose" in checked.message
        assert failed.message == checked.message and checked.seq < failed.seq
        # no second attempt at the pods once the check failed
        assert len(of_type(events, WorkerLaunched)) == 3
    finally:
        gate.write_text("")
        job.request_stop(cancel=True)
        thread.join(30)
        client.close()


def test_a_good_model_definition_is_checked_after_the_pods_are_created_and_the_job_goes_on(
    k8s: FakeKubernetes, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    """Ordering on the timeline: every first worker pod is launched before the check's end."""
    gate = tmp_path / "gate"
    body = (
        "def model():\n    return None\n"
        "def loss(model, batch):\n    return 0.0\n"
        "def dataset(split):\n    return list(range(16))\n"
    )
    model = gated_model_def(tmp_path / "good_model.py", gate, body)
    job, thread, results, client = run_checked_job(run_id, etcd, model, tmp_path)
    try:
        wait_for(lambda: len(pods(k8s)) == 3, 30, 0.05, "pods created during the check")
        gate.write_text("")
        prefix = f"/kfp-elastic/{run_id}"
        wait_for(
            lambda: of_type(read_timeline(client, prefix), ModelDefChecked),
            60,
            0.1,
            "the check's end on the timeline",
        )
        events = read_timeline(client, prefix)
        (checked,) = of_type(events, ModelDefChecked)
        launched = of_type(events, WorkerLaunched)
        assert checked.passed and checked.message == "" and checked.seconds > 0
        assert len(launched) == 3 and max(e.seq for e in launched) < checked.seq
        assert not results and not of_type(events, JobFailed)  # the job goes on
        assert len(pods(k8s)) == 3
    finally:
        gate.write_text("")
        job.request_stop(cancel=True)
        thread.join(30)
        client.close()
