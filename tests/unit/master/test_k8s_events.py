"""The master's Event recorder (master/k8s_events.py): client-go's correlation without I/O, and
the recorder against testing/api_server.py: Events about the pods by uid, a repeated Event
patched (count, lastTimestamp) instead of created again, a refusing or hanging API server
logged once and never felt by the caller."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from kfp_elastic.master.k8s_events import (
    COMBINED,
    Correlator,
    EventRecorder,
    event_body,
    timestamp,
)
from kfp_elastic.master.pod_events import COMPONENT, PodEvent
from kfp_elastic.master.timeline import JobDone, LaunchFailed, WorkerLaunched, WorkerLost
from kfp_elastic.testing.api_server import FakeKubernetes

NS = "kfp-elastic"
T0 = 1_700_000_000.0


def body(pod: str, message: str, now: float = T0, reason: str = "FailedCreate") -> dict[str, Any]:
    reference = {"kind": "Pod", "apiVersion": "v1", "namespace": NS, "name": pod, "uid": "u1"}
    event = PodEvent(pod, reason, "Warning", message)
    return event_body(event, reference, "master-1", now, f"{pod}.{int(now * 1e9):x}")


# -- the correlator (pure) ----------------------------------------------------------------------
def test_the_same_event_again_is_the_first_one_counted_and_patched() -> None:
    correlator = Correlator()
    first = correlator.correlate(body("m", "quota"), T0)
    assert first is not None and first.patch is None and first.body["count"] == 1
    again = correlator.correlate(body("m", "quota", T0 + 5), T0 + 5)
    assert again is not None
    assert again.body["metadata"]["name"] == first.body["metadata"]["name"]
    assert again.patch == {
        "count": 2,
        "lastTimestamp": timestamp(T0 + 5),
        "message": "quota",
    }
    assert again.body["firstTimestamp"] == timestamp(T0)
    other = correlator.correlate(body("m", "another"), T0 + 6)  # another message: a new Event
    assert other is not None and other.patch is None
    correlator.forget(again.body)  # gone from the server: created anew
    anew = correlator.correlate(body("m", "quota", T0 + 7), T0 + 7)
    assert anew is not None and anew.patch is None


def test_similar_events_are_combined_after_ten_within_ten_minutes() -> None:
    correlator = Correlator()
    results = [correlator.correlate(body("m", f"error {i}", T0 + i), T0 + i) for i in range(12)]
    assert all(r is not None for r in results)
    assert [r.patch is None for r in results if r] == [True] * 10 + [False] * 2
    tenth, eleventh, twelfth = results[9], results[10], results[11]
    assert tenth is not None and tenth.body["message"] == COMBINED + "error 9"
    assert eleventh is not None and eleventh.patch == {
        "count": 2,
        "lastTimestamp": timestamp(T0 + 10),
        "message": COMBINED + "error 10",
    }
    assert twelfth is not None and twelfth.body["count"] == 3
    # Ten minutes later the group starts over.
    later = correlator.correlate(body("m", "error 99"), T0 + 11 + 601)
    assert later is not None and later.body["message"] == "error 99" and later.patch is None


def test_each_object_gets_a_burst_then_one_event_per_refill() -> None:
    correlator = Correlator(burst=3, refill_s=300.0)
    sent = [correlator.correlate(body("m", f"{i}", reason=f"R{i}"), T0) for i in range(5)]
    assert [s is not None for s in sent] == [True, True, True, False, False]
    # another object has its own bucket
    assert correlator.correlate(body("w", "x"), T0) is not None
    assert correlator.correlate(body("m", "x", reason="R9"), T0 + 299) is None
    assert correlator.correlate(body("m", "y", reason="R9"), T0 + 301) is not None


# -- the recorder against the stand-in API server ------------------------------------------------
@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespace=NS, kubelet=False) as api:
        yield api


def api_client(fake: FakeKubernetes, token: str | None = None) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = fake.url
    if token:
        configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "python:3.12", "command": ["true"]}]},
    }


def mine(fake: FakeKubernetes) -> list[dict[str, Any]]:
    return [e for e in fake.events(ns=NS) if e["source"]["component"] == COMPONENT]


def test_events_are_about_the_pods_by_uid_and_a_repeated_one_is_patched(
    fake: FakeKubernetes,
) -> None:
    for name in ("master", "w-0-0", "w-0-1"):
        fake.create(NS, pod(name))
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in fake.list(NS)["items"]}
    with api_client(fake) as api:
        recorder = EventRecorder(NS, api, own_pod="master", instance="master-1").start()
        recorder.record(WorkerLaunched(name="w-0-0", index=0))
        recorder.record(WorkerLost(name="w-0-0", index=0, cause="evicted", message="drained"))
        recorder.record(
            WorkerLaunched(
                name="w-0-1", index=0, attempt=1, replaces="w-0-0", replaces_cause="evicted"
            )
        )
        for _ in range(3):  # the same refused create, three times: one Event, count 3
            recorder.record(LaunchFailed(index=1, message="exceeded quota"))
        recorder.record(JobDone(message="done"))
        recorder.close()
    events = mine(fake)
    assert [(e["involvedObject"]["name"], e["reason"], e["count"]) for e in events] == [
        ("w-0-0", "SuccessfulCreate", 1),
        ("w-0-0", "WorkerLost", 1),
        ("w-0-1", "WorkerReplaced", 1),
        ("master", "FailedCreate", 3),
        ("master", "JobSucceeded", 1),
    ]
    for event in events:
        ref = event["involvedObject"]
        assert ref == {
            "kind": "Pod",
            "apiVersion": "v1",
            "namespace": NS,
            "name": ref["name"],
            "uid": uids[ref["name"]],
        }
        assert event["source"] == {"component": COMPONENT, "host": "master-1"}
        assert event["reportingComponent"] == COMPONENT
        assert event["reportingInstance"] == "master-1"
    replaced = events[2]["message"]
    assert replaced == "Created worker pod w-0-1 (worker 0, attempt 1) to replace w-0-0 (evicted)"
    # the count is patched: create once, then two patches of that Event
    writes = [(c.verb, c.resource) for c in fake.api_calls if c.resource == "events"]
    assert writes == [("create", "events")] * 4 + [("patch", "events")] * 2 + [("create", "events")]
    assert recorder.written == 7


def test_outside_a_pod_only_the_workers_events_are_recorded(fake: FakeKubernetes) -> None:
    with api_client(fake) as api:
        recorder = EventRecorder(NS, api, own_pod=None).start()
        recorder.record(WorkerLaunched(name="w-0-0", index=0))  # its pod is gone: no uid
        recorder.record(JobDone(message="done"))
        recorder.close()
    (event,) = mine(fake)
    assert event["reason"] == "SuccessfulCreate" and "uid" not in event["involvedObject"]


def test_a_role_without_events_is_said_once_and_costs_the_caller_nothing(
    fake: FakeKubernetes, caplog: pytest.LogCaptureFixture
) -> None:
    fake.create(NS, pod("master"))
    token = fake.service_account_token(NS, "kfp-elastic-master")  # no Role: everything 403
    with api_client(fake, token) as api, caplog.at_level(logging.WARNING):
        recorder = EventRecorder(NS, api, own_pod="master", own_uid="u-master").start()
        for index in range(5):
            recorder.record(LaunchFailed(index=index, message=f"refused {index}"))
        recorder.close()
    assert not mine(fake) and recorder.written == 0
    said = [r.getMessage() for r in caplog.records if "Events not recorded" in r.getMessage()]
    assert len(said) == 1, said
    assert "may not create events" in said[0] and "cannot create resource" in said[0]


class HangingCore:
    """A CoreV1Api whose writes wait until released, then time out."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def create_namespaced_event(self, *_: Any, **__: Any) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait(30)
        raise urllib3.exceptions.ReadTimeoutError(None, "/api/v1/events", "read timed out")


def test_a_hanging_api_server_never_blocks_record_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = HangingCore()
    with client.ApiClient() as api, caplog.at_level(logging.WARNING):
        recorder = EventRecorder(NS, api, own_pod="master", own_uid="u", max_queued=2)
        recorder._core = core  # type: ignore[assignment]
        recorder.start()
        recorder.record(LaunchFailed(index=0, message="x"))
        assert core.entered.wait(10)
        # the first write hangs, two wait in the queue, the rest are dropped: record() returns
        for index in range(1, 6):
            recorder.record(LaunchFailed(index=index, message="x"))
        core.release.set()
        recorder.close(flush_s=10)
        recorder._thread.join(10)
    assert not recorder._thread.is_alive()
    assert core.calls == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("event queue full" in m for m in messages) == 1, messages
    assert sum("ReadTimeoutError" in m for m in messages) == 1, messages
    recorder.record(LaunchFailed(index=9, message="after close"))  # ignored, never raises
