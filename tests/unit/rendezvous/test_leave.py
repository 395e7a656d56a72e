"""The agent's leave on a termination signal (``rendezvous/leave.py``) and the watched copy's
stop (``etcd/watched_prefix.py``) never wait on the code the signal interrupted.

A signal handler runs on the main thread on top of whatever it was doing. An agent SIGTERMed
while its copy of the run's keys re-read them (a round change) held the copy's load lock in the
interrupted frame; the handler's leave then waited for that lock until the kubelet's SIGKILL
30 s later, and the serving pod that preempted it waited as long for its GPU.
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Iterator

import pytest
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.watched_prefix import WatchedPrefix
from kfp_elastic.rendezvous import leave
from tests.unit.rendezvous.test_handler import raw_client


@pytest.fixture
def started_cache(private_etcd) -> Iterator[tuple[MultiEndpointEtcd3Client, WatchedPrefix]]:
    """A client of the private etcd and a started copy of ``/s/`` read through it."""
    client = raw_client(private_etcd)
    try:
        cache = WatchedPrefix(client, "/s/")
        cache.start()
        yield client, cache
    finally:
        client.close()


def test_a_stop_from_inside_a_load_on_the_same_thread_returns_and_cancels_its_watches(
    started_cache,
) -> None:
    client, cache = started_cache
    read = client.get_range_response

    def interrupted_read(*args, **kwargs):  # a SIGTERM handler runs here, on this thread
        cache.stop()
        return read(*args, **kwargs)

    client.get_range_response = interrupted_read  # type: ignore[method-assign]
    loading = threading.Thread(target=cache._load_and_watch, daemon=True)
    loading.start()
    loading.join(30)
    assert not loading.is_alive(), "the stop waited for the load it interrupted"
    assert cache._watch_ids == []  # what the load started after the stop is cancelled


def test_a_stop_does_not_wait_for_another_threads_load_and_no_watch_outlives_it(
    started_cache,
) -> None:
    client, cache = started_cache
    reading, release = threading.Event(), threading.Event()
    read = client.get_range_response

    def slow_read(*args, **kwargs):
        reading.set()
        release.wait(30)
        return read(*args, **kwargs)

    client.get_range_response = slow_read  # type: ignore[method-assign]
    loading = threading.Thread(target=cache._load_and_watch, daemon=True)
    loading.start()
    assert reading.wait(30)
    stopping = threading.Thread(target=cache.stop, daemon=True)
    stopping.start()
    stopping.join(30)
    assert not stopping.is_alive(), "the stop waited for a load in progress"
    release.set()
    loading.join(30)
    assert not loading.is_alive() and cache._watch_ids == []


class _BlockedLeaver:
    """A leave that needs a lock the interrupted code holds."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.left = threading.Event()

    def leave(self, reason: str) -> None:
        with self.lock:
            self.left.set()


def test_the_signal_handler_lets_torchrun_stop_when_the_interrupted_code_holds_the_leaves_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leave, "LEAVE_WAIT_S", 0.2)
    monkeypatch.setattr(leave.slow_stop, "arm", lambda what, after_s=0.0: None)
    held = threading.Lock()
    leaver = _BlockedLeaver(held)
    monkeypatch.setattr(leave, "_leavers", weakref.WeakSet([leaver]))
    terminated: list[int] = []
    handler = leave._wrap(lambda signum, frame: terminated.append(signum))
    with held:  # the frame the signal interrupted
        handler(signal.SIGTERM, None)
        assert terminated == [signal.SIGTERM] and not leaver.left.is_set()
    assert leaver.left.wait(30), "the leave finishes once the interrupted code lets go"


def test_the_signal_handler_leaves_before_torchrun_stops_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leave.slow_stop, "arm", lambda what, after_s=0.0: None)
    leaver = _BlockedLeaver(threading.Lock())
    monkeypatch.setattr(leave, "_leavers", weakref.WeakSet([leaver]))
    order: list[str] = []
    handler = leave._wrap(lambda signum, frame: order.append(f"left={leaver.left.is_set()}"))
    handler(signal.SIGTERM, None)
    assert order == ["left=True"]
