"""A worker's own news of a lost peer (worker/peer_loss.py): the decision is pure; the watch
runs against a real etcd and a real elastic-etcd handler, whose leaving node stands for a peer
SIGKILLed (its record goes the same way: its lease is revoked)."""

from __future__ import annotations

import os
import threading

import pytest

from kfp_elastic.contract.nccl_env import NCCL_ERROR_HANDLING_ENV
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_env import ROUND_ENV
from kfp_elastic.rendezvous.round_formation import NodeRecord, RoundRecord
from kfp_elastic.worker.peer_loss import broken_reason, watch_stalls
from tests.conftest import HandlerFactory

ROUND = RoundRecord(4, ("a", "b"))


def node(node_id: str, waiting: bool = False, after_round: int = 3) -> NodeRecord:
    return NodeRecord(node_id, create_revision=1, waiting=waiting, after_round=after_round)


@pytest.mark.parametrize(
    ("latest", "live", "reason"),
    [
        (ROUND, [node("a"), node("b")], None),
        (ROUND, [node("a"), node("b"), node("c", waiting=True)], None),  # a newcomer breaks none
        (ROUND, [node("a")], "participant(s) lost: b"),
        (ROUND, [node("a"), node("b", waiting=True, after_round=4)], "participant(s) restarted: b"),
        (RoundRecord(5, ("a",)), [node("a")], "round 4 replaced by round 5"),
        (None, [node("a"), node("b")], "round 4 record gone"),
    ],
)
def test_a_round_is_broken_by_a_lost_or_restarted_participant_or_a_newer_round(
    latest: RoundRecord | None, live: list[NodeRecord], reason: str | None
) -> None:
    assert broken_reason(4, latest, {n.node_id: n for n in live}) == reason


def test_only_nccl_workers_get_a_stall_abort(etcd: EmbeddedEtcd, run_id: str) -> None:
    environ = {ROUND_ENV: "1"}
    settings = etcd.client_settings()
    assert watch_stalls("gloo", 5.0, settings, run_id, environ) is None  # fails by itself
    stall = watch_stalls("nccl", 5.0, None, run_id, environ, abort=lambda: None)
    assert stall is not None  # no etcd: SIGTERM alone starts it
    stall.close()


def test_a_peer_gone_from_the_round_aborts_the_stalled_worker_without_sigterm(
    make_handler: HandlerFactory,
    etcd: EmbeddedEtcd,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NCCL_ERROR_HANDLING_ENV, "3")
    monkeypatch.delenv(ROUND_ENV, raising=False)
    peer = make_handler(1, 1)
    info = peer.next_rendezvous()
    # What the workers of this round inherit from their agent.
    assert os.environ[ROUND_ENV] == "1" and info.world_size == 1
    assert os.environ[NCCL_ERROR_HANDLING_ENV] == "2"
    aborted = threading.Event()
    stall = watch_stalls("nccl", 0.0, etcd.client_settings(), run_id, abort=aborted.set)
    assert stall is not None
    try:
        assert stall.stop_reason is None  # the round is whole (checked as the watch started)
        peer.leave("SIGKILLed")  # its record goes, as a dead peer's does when probed
        assert aborted.wait(30)
        assert stall.aborted
        assert stall.stop_reason == f"round broken (participant(s) lost: {peer.node_id})"
    finally:
        stall.close()
