"""The master's watch of its own pod (master/own_pod.py): a graceful delete of that pod, and only
of that pod, calls the step-down; outside a pod or without its name there is no watch. Against
testing/api_server.py (its ``metadata.name`` field selector: testing/api_wire.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client, config

from kfp_elastic.master.own_pod import (
    POD_NAME_ENV,
    OwnPodWatch,
    deletion_started,
    own_pod_name,
)
from kfp_elastic.testing.api_server import FakeKubernetes

NS = "kfp-elastic"


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "python:3.12", "command": ["true"]}],
        },
    }


def v1pod(name: str, deleting: bool = False) -> Any:
    stamp = "2026-01-01T00:00:00Z" if deleting else None
    return SimpleNamespace(metadata=SimpleNamespace(name=name, deletion_timestamp=stamp))


def test_deletion_started_only_for_this_pod_once_it_is_terminating_or_gone() -> None:
    assert not deletion_started("MODIFIED", "master", v1pod("master"))
    assert deletion_started("MODIFIED", "master", v1pod("master", deleting=True))
    assert deletion_started("ADDED", "master", v1pod("master", deleting=True))  # at (re)start
    assert deletion_started("DELETED", "master", v1pod("master"))  # force-deleted
    assert not deletion_started("DELETED", "master", v1pod("worker-0"))
    assert not deletion_started("MODIFIED", "master", v1pod("worker-0", deleting=True))


def test_own_pod_name_needs_a_pod_and_its_name() -> None:
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert own_pod_name({**in_pod, POD_NAME_ENV: "train-abc"}) == "train-abc"
    assert own_pod_name(in_pod) is None  # no name: SIGTERM alone
    assert own_pod_name({POD_NAME_ENV: "train-abc"}) is None  # not in a pod


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[tuple[FakeKubernetes, client.Configuration]]:
    with FakeKubernetes(namespace=NS, kubelet=False) as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            "users: [{name: fake, user: {}}]\n"
        )
        configuration = client.Configuration()
        config.load_kube_config(str(kubeconfig), client_configuration=configuration)
        yield fake, configuration


def test_a_graceful_delete_of_the_own_pod_calls_the_step_down_once(
    k8s: tuple[FakeKubernetes, client.Configuration],
) -> None:
    fake, configuration = k8s
    for name in ("master", "worker-0"):
        fake.create(NS, pod(name))
        fake.bind(NS, name, "node-1")  # scheduled: a delete is graceful (Terminating)
    called = threading.Event()
    calls: list[str] = []

    def on_deleting() -> None:
        calls.append("step down")
        called.set()

    watch = OwnPodWatch(
        "master", NS, on_deleting, lambda: client.ApiClient(configuration), retry_s=0.1
    ).start()
    try:
        fake.delete(NS, "worker-0")  # another pod going: nothing
        fake.delete(NS, "master")
        assert called.wait(20), "the watch did not see its pod's deletion"
        fake.finish_deletion("master", ns=NS)  # the pod goes: no second call
        assert watch.fired.is_set()
        watch._thread.join(10)
        assert calls == ["step down"]
    finally:
        watch.stop()


def test_a_watch_started_on_a_pod_already_terminating_fires_at_once(
    k8s: tuple[FakeKubernetes, client.Configuration],
) -> None:
    fake, configuration = k8s
    fake.create(NS, pod("master"))
    fake.bind(NS, "master", "node-1")
    fake.delete(NS, "master")
    called = threading.Event()
    watch = OwnPodWatch("master", NS, called.set, lambda: client.ApiClient(configuration)).start()
    try:
        assert called.wait(20)
    finally:
        watch.stop()


def test_the_fake_serves_pod_field_selectors_and_refuses_unknown_fields(
    k8s: tuple[FakeKubernetes, client.Configuration],
) -> None:
    fake, configuration = k8s
    for name in ("master", "worker-0"):
        fake.create(NS, pod(name))
    with client.ApiClient(configuration) as api:
        core = client.CoreV1Api(api)
        listed = core.list_namespaced_pod(NS, field_selector="metadata.name=master").items
        assert [p.metadata.name for p in listed] == ["master"]
        fake.set_phase("worker-0", "Running")
        running = core.list_namespaced_pod(NS, field_selector="status.phase=Running").items
        assert [p.metadata.name for p in running] == ["worker-0"]
        others = core.list_namespaced_pod(NS, field_selector="metadata.name!=master").items
        assert [p.metadata.name for p in others] == ["worker-0"]
        with pytest.raises(client.ApiException) as refused:
            core.list_namespaced_pod(NS, field_selector="spec.priority=3")
        assert refused.value.status == 400
        assert 'field label not supported: \\"spec.priority\\"' in str(refused.value.body)
