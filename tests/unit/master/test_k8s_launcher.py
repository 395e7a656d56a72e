"""KubernetesLauncher through the real ``kubernetes`` client against testing/api_server.py
(HTTP on
127.0.0.1): launch, classify preemption vs failure, resume watches after stream end and 410."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kfp_elastic.master.k8s_launcher import KubernetesLauncher, LaunchError, forbidden_message
from kfp_elastic.master.launcher import (
    LauncherForbidden,
    Reason,
    WorkerEvent,
    WorkerHandle,
    WorkerPhase,
    next_attempts,
)
from kfp_elastic.master.pod_spec import JOB_LABEL, WorkerPodSpec, build_pod
from kfp_elastic.master.pod_status import classify
from kfp_elastic.testing.api_server import FakeKubernetes

NS = "kfp-elastic"
TEMPLATE = WorkerPodSpec(
    job_name="job",
    image="kfp-elastic-worker:0.1.0",
    entrypoint="train.py",
    rdzv_endpoint="kfp-elastic-etcd:2379",
    min_nodes=1,
    max_nodes=4,
)
P, R, S, F, D = (
    WorkerPhase.PENDING,
    WorkerPhase.RUNNING,
    WorkerPhase.SUCCEEDED,
    WorkerPhase.FAILED,
    WorkerPhase.DELETED,
)


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2
    while (extra := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not extra, f"threads left running: {extra}"


@pytest.fixture
def k8s() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespace=NS) as fake:
        yield fake
    with pytest.raises(OSError):  # the port is closed again
        socket.create_connection(("127.0.0.1", fake.port), timeout=1).close()


@pytest.fixture
def api(k8s: FakeKubernetes) -> Iterator[client.ApiClient]:
    api = client.ApiClient(client.Configuration(host=k8s.url))
    yield api
    api.close()
    api.rest_client.pool_manager.clear()  # close pooled keep-alive sockets


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def launcher(api: client.ApiClient) -> KubernetesLauncher:
    return KubernetesLauncher(TEMPLATE, NS, api)


class Watcher:
    """Runs ``launcher.watch`` in a thread and records its events."""

    def __init__(self, launcher: KubernetesLauncher) -> None:
        self.events: list[WorkerEvent] = []
        self._cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=launcher.watch, args=(self._on, self.stop))
        self.thread.start()
        # Changes made after the initial list reach the launcher as events, in order.
        eventually(lambda: launcher.list_count >= 1)

    def _on(self, event: WorkerEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait(
        self, name: str, phase: WorkerPhase, reason: Reason | None = None, timeout: float = 5.0
    ) -> WorkerEvent:
        def found() -> WorkerEvent | None:
            return next(
                (e for e in self.events if (e.name, e.phase, e.reason) == (name, phase, reason)),
                None,
            )

        with self._cond:
            assert self._cond.wait_for(found, timeout), f"no {phase}/{reason} for {name}: " + str(
                self.trail(name)
            )
            return found()  # type: ignore[return-value]

    def trail(self, name: str) -> list[tuple[WorkerPhase, Reason | None]]:
        with self._cond:
            return [(e.phase, e.reason) for e in self.events if e.name == name]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def watcher(launcher: KubernetesLauncher) -> Iterator[Watcher]:
    w = Watcher(launcher)
    yield w
    w.close()


def eventually(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_launch_submits_the_built_pod_and_reports_pending(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    handle = launcher.launch(0)
    assert handle == WorkerHandle("job-worker-0-0", 0, 0)
    event = watcher.wait(handle.name, P)
    assert (event.worker_index, event.attempt, event.exit_code) == (0, 0, None)
    pod = k8s.pod(handle.name)
    expected = build_pod(replace(TEMPLATE, namespace=NS))
    assert pod["metadata"]["labels"] == expected["metadata"]["labels"]
    assert pod["spec"]["containers"][0]["args"] == expected["spec"]["containers"][0]["args"]
    assert pod["spec"]["priority"] == -3  # the fake's Priority admission read the class
    assert pod["spec"]["preemptionPolicy"] == "PreemptLowerPriority"  # worker 0: guaranteed
    assert pod["status"]["phase"] == "Pending"


def test_running_then_completed_then_deleted(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    name = launcher.launch(0).name
    watcher.wait(name, P)
    k8s.set_phase(name, "Running")
    assert watcher.wait(name, R).node == "fake-node-1"
    k8s.set_phase(name, "Succeeded")
    assert watcher.wait(name, S, Reason.COMPLETED).exit_code == 0
    launcher.delete(name)
    watcher.wait(name, D, Reason.COMPLETED)
    assert watcher.trail(name) == [
        (P, None),
        (R, None),
        (S, Reason.COMPLETED),
        (D, Reason.COMPLETED),
    ]


@pytest.mark.parametrize("reason", ["PreemptionByScheduler", "PreemptionByKubeScheduler"])
def test_preemption_is_a_disruption_not_a_failure(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes, reason: str
) -> None:
    name = launcher.launch(0).name
    k8s.set_phase(name, "Running")
    watcher.wait(name, R)
    k8s.preempt(name, reason=reason)
    gone = watcher.wait(name, D, Reason.PREEMPTED)
    assert gone.is_disruption and not gone.is_failure and reason in gone.message
    assert watcher.trail(name) == [
        (P, None),
        (R, None),
        (R, Reason.PREEMPTED),
        (F, Reason.PREEMPTED),
        (D, Reason.PREEMPTED),
    ]


def test_an_eviction_by_kueue_is_a_preemption(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    """Kueue stops a plain pod it evicts with its own condition (TerminationTarget), not
    DisruptionTarget, then deletes it: a preemption, not a failure nor an unexplained delete."""
    from kfp_elastic.testing.cluster.kueue import stop_pod

    name = launcher.launch(0).name
    k8s.set_phase(name, "Running")
    watcher.wait(name, R)
    stop_pod(k8s, NS, name)
    gone = watcher.wait(name, D, Reason.PREEMPTED)
    assert gone.is_disruption and not gone.is_failure
    assert "WorkloadEvictedDueToPreempted" in gone.message


def test_non_zero_exit_is_a_failure_and_stays_one_after_deletion(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    name = launcher.launch(0).name
    k8s.set_phase(name, "Running")
    k8s.set_phase(name, "Failed", exit_code=137, container_reason="OOMKilled")
    failed = watcher.wait(name, F, Reason.ERROR)
    assert failed.is_failure and failed.exit_code == 137 and "OOMKilled" in failed.message
    launcher.delete(name)
    assert watcher.wait(name, D, Reason.ERROR).exit_code == 137


def test_eviction_and_node_loss_are_disruptions(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    evicted, lost = launcher.launch(0).name, launcher.launch(1).name
    for name in (evicted, lost):
        k8s.set_phase(name, "Running")
    k8s.evict(evicted)
    k8s.lose_node(lost)
    assert watcher.wait(evicted, F, Reason.EVICTED).is_disruption
    assert watcher.wait(lost, D, Reason.NODE_LOST).is_disruption
    # Evicted pods stay listed (Failed) until someone deletes them.
    assert [w.name for w in launcher.list_workers()] == [evicted]


def test_deleted_by_launcher_or_by_someone_else(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes, core: client.CoreV1Api
) -> None:
    ours, theirs, pending = (launcher.launch(i).name for i in range(3))
    for name in (ours, theirs):
        k8s.set_phase(name, "Running")
        watcher.wait(name, R)
    launcher.delete(ours)
    core.delete_namespaced_pod(theirs, NS)
    launcher.delete(pending)
    launcher.delete("job-worker-9-9")  # already gone: not an error
    watcher.wait(ours, D, Reason.DELETED)
    # The kubelet's SIGTERM (exit 143) during a delete is not a failure of the worker.
    assert watcher.trail(ours) == [
        (P, None),
        (R, None),
        (R, Reason.DELETED),
        (F, Reason.DELETED),
        (D, Reason.DELETED),
    ]
    assert watcher.wait(theirs, D, Reason.DELETED_EXTERNALLY).is_disruption
    # Each pod's events arrive in their own order: wait for the pending pod's own deletion.
    watcher.wait(pending, D, Reason.DELETED)
    assert watcher.trail(pending) == [(P, None), (D, Reason.DELETED)]


def test_taken_names_move_to_the_next_attempt(
    launcher: KubernetesLauncher, core: client.CoreV1Api
) -> None:
    # A previous master created attempts 0 and 1 of worker 1.
    for attempt in (0, 1):
        core.create_namespaced_pod(
            NS, build_pod(replace(TEMPLATE, worker_index=1, attempt=attempt))
        )
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod(NS, build_pod(replace(TEMPLATE, worker_index=1)))
    assert caught.value.status == 409 and json.loads(caught.value.body)["reason"] == "AlreadyExists"
    assert launcher.launch(1) == WorkerHandle("job-worker-1-2", 1, 2)
    assert launcher.launch(1).attempt == 3
    assert launcher.launch(0).attempt == 0


def test_a_new_master_names_pods_after_every_attempt_in_its_table(api: client.ApiClient) -> None:
    # An earlier master launched worker 0 twice (both pods are gone now) and worker 2 once.
    table = {
        "job-worker-0-0": {"index": 0, "attempt": 0, "ended": True},
        "job-worker-0-1": {"index": 0, "attempt": 1, "ended": True},
        "job-worker-2-0": {"index": 2, "attempt": 0},
    }
    assert next_attempts(table) == {0: 2, 2: 1}
    launcher = KubernetesLauncher(TEMPLATE, NS, api, first_attempts=next_attempts(table))
    assert launcher.launch(0) == WorkerHandle("job-worker-0-2", 0, 2)  # not the gone 0-0
    assert launcher.launch(2).attempt == 1 and launcher.launch(1).attempt == 0


def test_refused_pod_raises_a_named_error(api: client.ApiClient) -> None:
    launcher = KubernetesLauncher(
        replace(TEMPLATE, guaranteed_priority_class="no-such-class"), NS, api
    )
    with pytest.raises(LaunchError, match="403 .*no PriorityClass with name no-such-class"):
        launcher.launch(0)
    with pytest.raises(ValueError, match="template namespace"):
        KubernetesLauncher(replace(TEMPLATE, namespace="other"), NS, api)


def test_list_workers_sees_only_this_job(
    launcher: KubernetesLauncher, k8s: FakeKubernetes, core: client.CoreV1Api
) -> None:
    running = launcher.launch(0).name
    launcher.launch(1)
    core.create_namespaced_pod(NS, build_pod(replace(TEMPLATE, job_name="other")))
    k8s.set_phase(running, "Running")
    statuses = {s.name: (s.phase, s.worker_index) for s in launcher.list_workers()}
    assert statuses == {"job-worker-0-0": (R, 0), "job-worker-1-0": (P, 1)}


def test_410_gone_relists_and_loses_no_event(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes, core: client.CoreV1Api
) -> None:
    a, b = launcher.launch(0).name, launcher.launch(1).name
    watcher.wait(b, P)
    assert launcher.list_count == 1
    # Cut the watch and keep the launcher out while things change, then compact the history
    # it would resume from: its reconnect gets 410 Gone and must fall back to a list.
    k8s.hold_watches()
    k8s.close_watches()
    eventually(lambda: k8s.open_watches == 0)
    k8s.set_phase(a, "Running")
    core.delete_namespaced_pod(b, NS)
    c = launcher.launch(2).name
    k8s.compact()
    k8s.release_watches()
    watcher.wait(a, R)
    watcher.wait(b, D, Reason.DELETED_EXTERNALLY)
    watcher.wait(c, P)
    assert launcher.list_count == 2
    k8s.set_phase(c, "Running")  # and the new watch works
    watcher.wait(c, R)
    assert watcher.trail(a) == [(P, None), (R, None)]  # nothing twice, nothing lost
    assert watcher.trail(b) == [(P, None), (D, Reason.DELETED_EXTERNALLY)]


def test_stream_end_resumes_from_the_last_resource_version(
    launcher: KubernetesLauncher, watcher: Watcher, k8s: FakeKubernetes
) -> None:
    name = launcher.launch(0).name
    watcher.wait(name, P)
    seen = k8s.pod(name)["metadata"]["resourceVersion"]
    eventually(lambda: k8s.open_watches == 1)
    k8s.close_watches()
    k8s.set_phase(name, "Running")
    watcher.wait(name, R)
    watches = [q for m, _, q in k8s.requests if m == "GET" and q.get("watch") == "True"]
    assert len(watches) >= 2 and watches[1]["resourceVersion"] == seen
    assert launcher.list_count == 1  # resumed, not re-listed
    assert watcher.trail(name) == [(P, None), (R, None)]


def test_server_side_timeout_reconnects(api: client.ApiClient, k8s: FakeKubernetes) -> None:
    launcher = KubernetesLauncher(TEMPLATE, NS, api, watch_timeout_s=1)
    w = Watcher(launcher)
    try:
        eventually(lambda: launcher.watch_count >= 2, timeout=3)
        name = launcher.launch(0).name
        w.wait(name, P)
    finally:
        w.close()
    assert launcher.list_count == 1


def test_stop_interrupts_an_idle_watch_at_once(launcher: KubernetesLauncher) -> None:
    w = Watcher(launcher)
    eventually(lambda: launcher.watch_count == 1)
    started = time.monotonic()
    w.close()
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available",
                    }
                ],
            },
            (P, Reason.UNSCHEDULABLE),
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"name": "worker", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
                ],
            },
            (P, Reason.START_ERROR),
        ),
        (
            {"phase": "Failed", "reason": "OutOfcpu", "message": "Node didn't have enough cpu"},
            (F, Reason.REJECTED),
        ),
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, (F, Reason.ERROR)),
        (
            {"phase": "Failed", "reason": "Terminated", "message": "node shutdown"},
            (F, Reason.NODE_LOST),
        ),
        (
            {
                "phase": "Running",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "EvictionByEvictionAPI",
                    }
                ],
            },
            (R, Reason.EVICTED),
        ),
        (
            {
                "phase": "Running",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "False",
                        "reason": "EvictionByEvictionAPI",
                    }
                ],
            },
            (R, None),
        ),
        ({"phase": "Unknown"}, (R, None)),
    ],
)
def test_classify_pure(status: dict, expected: tuple) -> None:
    pod = {
        "metadata": {"name": "p", "labels": {"kfp-elastic.io/worker-index": "4"}},
        "spec": {},
        "status": status,
    }
    result = classify(pod)
    assert (result.phase, result.reason) == expected and result.worker_index == 4


# -- the fake itself: what the real API server does ---------------------------------------


def raw_get(k8s: FakeKubernetes, path: str) -> tuple[int, list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", k8s.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, [json.loads(line) for line in resp.read().splitlines() if line]
    finally:
        conn.close()


@pytest.mark.parametrize("flag", ["true", "1", "True"])
def test_fake_streams_watch_events_for_every_watch_spelling(
    k8s: FakeKubernetes, core: client.CoreV1Api, flag: str
) -> None:
    core.create_namespaced_pod(NS, build_pod(TEMPLATE))
    status, events = raw_get(k8s, f"/api/v1/namespaces/{NS}/pods?watch={flag}&timeoutSeconds=0.2")
    assert status == 200 and [e["type"] for e in events] == ["ADDED"]
    assert events[0]["object"]["metadata"]["name"] == "job-worker-0-0"


def test_fake_watch_from_compacted_version_is_an_error_event_410(
    k8s: FakeKubernetes, core: client.CoreV1Api
) -> None:
    old = core.create_namespaced_pod(NS, build_pod(TEMPLATE)).metadata.resource_version
    core.patch_namespaced_pod("job-worker-0-0", NS, {"metadata": {"labels": {"x": "1"}}})
    k8s.compact()
    status, events = raw_get(k8s, f"/api/v1/namespaces/{NS}/pods?watch=1&resourceVersion={old}")
    assert status == 200 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"
    with pytest.raises(ApiException) as caught:
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=1
        ):
            pass
    assert caught.value.status == 410


def test_fake_selectors_versions_and_errors(k8s: FakeKubernetes, core: client.CoreV1Api) -> None:
    created = [
        core.create_namespaced_pod(NS, build_pod(replace(TEMPLATE, worker_index=i)))
        for i in range(3)
    ]
    versions = [int(p.metadata.resource_version) for p in created]
    assert versions == sorted(set(versions))
    patched = core.patch_namespaced_pod("job-worker-1-0", NS, {"metadata": {"labels": {"t": "b"}}})
    assert int(patched.metadata.resource_version) > versions[-1]
    listed = core.list_namespaced_pod(NS, label_selector=f"{JOB_LABEL}=job,t in (a,b)")
    assert [p.metadata.name for p in listed.items] == ["job-worker-1-0"]
    assert int(listed.metadata.resource_version) >= int(patched.metadata.resource_version)
    listed = core.list_namespaced_pod(NS, label_selector="!t,kfp-elastic.io/worker-index!=0")
    assert [p.metadata.name for p in listed.items] == ["job-worker-2-0"]
    assert core.list_namespaced_pod("elsewhere").items == []

    def status_of(call: Callable[[], object]) -> tuple[int, str]:
        with pytest.raises(ApiException) as caught:
            call()
        return caught.value.status, json.loads(caught.value.body)["reason"]

    assert status_of(lambda: core.read_namespaced_pod("nope", NS)) == (404, "NotFound")
    assert status_of(
        lambda: core.patch_namespaced_pod(
            "job-worker-0-0", NS, {"metadata": {"resourceVersion": str(versions[0] - 1)}}
        )
    ) == (409, "Conflict")
    assert status_of(
        lambda: core.patch_namespaced_pod("job-worker-0-0", NS, {"spec": {"nodeName": "elsewhere"}})
    ) == (422, "Invalid")
    assert status_of(
        lambda: core.delete_namespaced_pod(
            "job-worker-0-0", NS, body={"preconditions": {"uid": "not-the-uid"}}
        )
    ) == (409, "Conflict")
    assert status_of(
        lambda: core.create_namespaced_pod(
            NS, build_pod(replace(TEMPLATE, service_account="ghost"))
        )
    ) == (403, "Forbidden")
    assert status_of(lambda: core.list_namespaced_pod(NS, label_selector="a in b")) == (
        400,
        "BadRequest",
    )


def test_fake_watch_follows_the_label_selector(k8s: FakeKubernetes, core: client.CoreV1Api) -> None:
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, build_pod(TEMPLATE))
    core.patch_namespaced_pod("job-worker-0-0", NS, {"metadata": {"labels": {"t": "x"}}})
    core.patch_namespaced_pod("job-worker-0-0", NS, {"metadata": {"labels": {"t": None}}})
    core.delete_namespaced_pod("job-worker-0-0", NS)
    stream = watch.Watch().stream(
        core.list_namespaced_pod, NS, label_selector="t=x", resource_version=rv, timeout_seconds=0.3
    )
    # Entering the selection is ADDED, leaving it DELETED, as the real watch cache reports.
    assert [e["type"] for e in stream] == ["ADDED", "DELETED"]


# -- RBAC: a refused call fails at once and says what to grant --------------------------------


@pytest.mark.parametrize("verb", ["create", "list", "watch", "delete"])
def test_rbac_denial_names_the_verb_and_what_to_grant(k8s: FakeKubernetes, verb: str) -> None:
    sa = "kfp-elastic-master"
    verbs = [v for v in ("create", "list", "watch", "delete") if v != verb]
    k8s.create_object(
        "roles",
        NS,
        {
            "metadata": {"name": sa},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": verbs}],
        },
    )
    k8s.create_object(
        "rolebindings",
        NS,
        {
            "metadata": {"name": sa},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa}],
        },
    )
    configuration = client.Configuration(host=k8s.url)
    configuration.api_key = {"authorization": f"Bearer {k8s.service_account_token(NS, sa)}"}
    api = client.ApiClient(configuration)
    launcher = KubernetesLauncher(TEMPLATE, NS, api)
    calls = {
        "create": lambda: launcher.launch(0),
        "list": launcher.list_workers,
        "watch": lambda: next(launcher.events(threading.Event())),
        "delete": lambda: launcher.delete("job-worker-0-0"),
    }
    try:
        with pytest.raises(LauncherForbidden) as caught:
            calls[verb]()
    finally:
        launcher.close()
        api.close()
        api.rest_client.pool_manager.clear()
    assert str(caught.value).startswith(
        f"the master's service account (system:serviceaccount:{NS}:{sa}) may not {verb} pods "
        f"in namespace {NS}: grant verb '{verb}' on 'pods' in its Role "
        "(manifests/base/rbac.yaml, Role kfp-elastic-master); the API server said: "
    )


def test_forbidden_message_only_for_rbac_denials() -> None:
    admission = 'pods "w" is forbidden: no PriorityClass with name x was found'
    assert forbidden_message(admission, NS) is None
    eviction = (
        'pods "w" is forbidden: User "system:serviceaccount:ns:sa" cannot create resource '
        '"pods/eviction" in API group "" in the namespace "ns"'
    )
    assert "grant verb 'create' on 'pods/eviction' in its Role" in str(
        forbidden_message(eviction, "ns")
    )


def test_an_api_server_that_never_answers_fails_a_call_after_the_request_timeout() -> None:
    """A create, delete or list that gets no answer fails (LaunchError, or the client's
    error) once ``request_timeout_s`` has passed, instead of holding the master forever."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{silent.getsockname()[1]}"))
    try:
        config = api.configuration
        config.retries = 0  # urllib3 would retry a read timeout otherwise
        launcher = KubernetesLauncher(TEMPLATE, NS, api, request_timeout_s=0.5)
        with pytest.raises(LaunchError, match="no answer from the API server"):
            launcher.launch(0)
        with pytest.raises(Exception, match="[Tt]imeout|timed out"):
            launcher.list_workers()
        with pytest.raises(Exception, match="[Tt]imeout|timed out"):
            launcher.delete("w")
    finally:
        stop.set()
        thread.join(5)
        api.close()
        api.rest_client.pool_manager.clear()
        for conn in accepted:
            conn.close()
        silent.close()
