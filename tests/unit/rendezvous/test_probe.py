"""The peer probe (``rendezvous/probe.py``): a refused connection means the peer is gone, a
closed one too, and a connection is given ``probe_connect_timeout`` to be made."""

from __future__ import annotations

import socket
import threading

import pytest

from kfp_elastic.rendezvous import probe
from kfp_elastic.rendezvous.probe import PeerProbe, ProbeTarget


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_refused_connection_reports_the_peer_dead() -> None:
    dead: list[ProbeTarget] = []
    prober = PeerProbe("127.0.0.1", dead.append)
    try:
        target = ProbeTarget("gone", f"127.0.0.1:{free_port()}", lease=7)
        prober.watch([target])
        assert dead == [target]
    finally:
        prober.stop()


def test_a_watched_peer_that_stops_is_reported_dead() -> None:
    found = threading.Event()
    dead: list[ProbeTarget] = []

    def on_dead(target: ProbeTarget) -> None:
        dead.append(target)
        found.set()

    peer = PeerProbe("127.0.0.1", lambda target: None)
    prober = PeerProbe("127.0.0.1", on_dead)
    try:
        target = ProbeTarget("peer", peer.address, lease=8)
        prober.watch([target])
        assert dead == []
        peer.stop()
        assert found.wait(30), "the closed connection was not noticed"
        assert dead == [target]
    finally:
        prober.stop()


@pytest.mark.parametrize("timeout", [probe.CONNECT_TIMEOUT_S, 0.25, 7.0])
def test_a_connection_gets_the_configured_timeout(
    timeout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``--rdzv-conf probe_connect_timeout`` sets (membership passes it here); a
    connection not made in time leaves the peer to its lease."""
    asked: list[float] = []

    def unreachable(address: tuple[str, int], connect_timeout: float) -> socket.socket:
        asked.append(connect_timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(probe.socket, "create_connection", unreachable)
    dead: list[ProbeTarget] = []
    prober = PeerProbe("127.0.0.1", dead.append, connect_timeout=timeout)
    try:
        prober.watch([ProbeTarget("slow", "192.0.2.1:9", lease=9)])
        assert asked == [timeout]
        assert dead == []  # a timeout is never taken as death
    finally:
        prober.stop()
