"""master.state against a real etcd: leadership, fencing, takeover, timeline, restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.master.state import MasterState, NotLeaderError
from kfp_elastic.master.timeline import (
    Committed,
    JobDone,
    JobFailed,
    MasterStarted,
    of_type,
    read_timeline,
)
from tests.helpers import REPO_ROOT


@pytest.fixture
def prefix(run_id: str) -> str:
    return f"/kfp-elastic/{run_id}"


def test_second_master_waits_and_takes_over_when_the_first_releases(
    client: MultiEndpointEtcd3Client, prefix: str
) -> None:
    first, second = (
        MasterState(client, prefix, lease_ttl=2),
        MasterState(client, prefix, lease_ttl=2),
    )
    try:
        assert first.acquire(timeout=5)
        assert first.leader()["id"] == first.identity
        assert not second.acquire(timeout=0.5)
        took: list[float] = []
        thread = threading.Thread(
            target=lambda: took.append(second.acquire(timeout=10) and time.monotonic())
        )
        thread.start()
        time.sleep(0.3)
        released = time.monotonic()
        first.release()
        thread.join(10)
        assert took and took[0] - released < 1.0  # a watch, not a TTL wait
        assert second.is_leader and second.leader()["id"] == second.identity
    finally:
        first.release()
        second.release()


def test_takeover_after_the_leader_is_sigkilled_takes_about_one_ttl(
    etcd: EmbeddedEtcd, client: MultiEndpointEtcd3Client, prefix: str
) -> None:
    code = (
        "import sys, time; from kfp_elastic.master.state import MasterState; "
        "from kfp_elastic.etcd.client import connect; "
        "from kfp_elastic.etcd.settings import EtcdSettings; "
        f"c = connect(EtcdSettings.for_endpoint({etcd.endpoint!r})); "
        f"s = MasterState(c, {prefix!r}, lease_ttl=2); "
        "assert s.acquire(timeout=10); print('leader', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    successor = MasterState(client, prefix, lease_ttl=2)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"leader"
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        killed = time.monotonic()
        assert successor.acquire(timeout=10)
        waited = time.monotonic() - killed
        assert 0.5 < waited < 4.0, waited  # the dead master's lease had to expire first
    finally:
        proc.kill()
        proc.wait()
        successor.release()


def test_a_master_that_lost_its_lease_cannot_write(
    client: MultiEndpointEtcd3Client, prefix: str
) -> None:
    old, new = MasterState(client, prefix, lease_ttl=2), MasterState(client, prefix, lease_ttl=2)
    try:
        assert old.acquire(timeout=5)
        old.set_status("running")
        _, meta = client.get(old.keys.leader)
        client.revoke_lease(meta.lease_id)  # as if it had expired during a partition
        assert new.acquire(timeout=5)
        with pytest.raises(NotLeaderError):
            old.set_status("failed", "stale master")
        with pytest.raises(NotLeaderError):
            old.append_event(JobFailed())
        assert old.lost.is_set() and not old.is_leader
        assert new.status()["state"] == "running"
    finally:
        old.release()
        new.release()


def test_timeline_appends_in_order_with_unique_sequence_numbers(
    client: MultiEndpointEtcd3Client, prefix: str
) -> None:
    state = MasterState(client, prefix, lease_ttl=2)
    try:
        assert state.acquire(timeout=5)
        first = state.append_event(MasterStarted(run_id="x"))
        threads = [
            threading.Thread(target=lambda i=i: state.append_event(Committed(step=i)))
            for i in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        state.append_event(JobDone(message="ok"))
        timeline = read_timeline(client, prefix)
        assert [e.seq for e in timeline] == list(range(1, 11)) and first.seq == 1
        # A listener added later sees the later events as stored, in order; one that raises
        # costs the write nothing.
        heard: list[int] = []

        def broken(_: object) -> None:
            raise RuntimeError("listener down")

        state.add_listener(broken)
        state.add_listener(lambda event: heard.append(event.seq))
        threads = [
            threading.Thread(target=lambda i=i: state.append_event(Committed(step=100 + i)))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert heard == [11, 12, 13, 14]
        assert isinstance(timeline[0], MasterStarted) and timeline[0].run_id == "x"
        assert isinstance(timeline[-1], JobDone) and timeline[-1].message == "ok"
        assert sorted(e.step for e in of_type(timeline, Committed)) == list(range(8))
        assert all(e.t > 0 for e in timeline)
        value, _ = client.get(f"{prefix}/events/0000000001")
        assert value is not None
    finally:
        state.release()


def test_state_survives_a_master_restart(client: MultiEndpointEtcd3Client, prefix: str) -> None:
    first = MasterState(client, prefix, lease_ttl=2)
    assert first.acquire(timeout=5)
    first.save_spec({"run_id": "x", "min_workers": 1})
    first.set_status("running")
    first.update_worker("worker-0-0", index=0, attempt=0, pid=123, tag="t0")
    first.update_worker("worker-0-0", ended="preempted")
    first.set_observed({"round_revision": 7})
    first.release()
    second = MasterState(client, prefix, lease_ttl=2)
    try:
        assert second.acquire(timeout=5)
        assert second.spec() == {"run_id": "x", "min_workers": 1}
        assert second.status()["state"] == "running"
        assert second.workers() == {
            "worker-0-0": {"index": 0, "attempt": 0, "pid": 123, "tag": "t0", "ended": "preempted"}
        }
        assert second.observed() == {"round_revision": 7}
        with pytest.raises(ValueError, match="job state must be one of"):
            second.set_status("paused")
    finally:
        second.release()


def test_a_master_that_starts_while_etcd_restarts_waits_for_it(
    client: MultiEndpointEtcd3Client, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease request fails while etcd is away (as after a crash of master and etcd alike):
    the master asks again instead of exiting, and leads once etcd answers."""
    from pyetcd.exceptions import ConnectionFailedError

    from kfp_elastic.master import state as state_module

    calls = []

    def grant_after_two_failures(etcd: MultiEndpointEtcd3Client, ttl: float) -> int:
        calls.append(ttl)
        if len(calls) <= 2:
            raise ConnectionFailedError()
        return real_grant(etcd, ttl)

    real_grant = state_module.grant
    monkeypatch.setattr(state_module, "grant", grant_after_two_failures)
    state = MasterState(client, prefix, lease_ttl=2)
    try:
        assert state.acquire(timeout=10) and state.is_leader
        assert len(calls) == 3
    finally:
        state.release()


def test_an_etcd_that_stays_away_fails_the_master_after_its_outage_wait(
    client: MultiEndpointEtcd3Client, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--etcd-outage-wait`` bounds the wait: past it the lease request's error ends the
    master's start, naming etcd, instead of a retry."""
    from pyetcd.exceptions import ConnectionFailedError

    from kfp_elastic.etcd.client import EtcdConnectionError
    from kfp_elastic.master import state as state_module

    calls = []

    def never_granted(etcd: MultiEndpointEtcd3Client, ttl: float) -> int:
        calls.append(ttl)
        raise ConnectionFailedError()

    monkeypatch.setattr(state_module, "grant", never_granted)
    state = MasterState(client, prefix, lease_ttl=2, outage_wait_s=0.3)
    with pytest.raises(EtcdConnectionError, match="granting the leadership lease"):
        state.acquire(timeout=10)
    assert len(calls) >= 2  # asked again within the wait, then gave up
