"""The etcd layer's shared pieces against a real etcd: the leader election and its guarded
writes (``election.py``), the create-if-absent and unchanged-since-read guards
(``transactions.py``), the JSON record readers (``records.py``) and the lease keeper."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import grpc
import pytest
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.election import LeaderKey, WriteOutcome
from kfp_elastic.etcd.leases import LeaseKeeper, grant
from kfp_elastic.etcd.records import decode_json, decode_record, read_json, read_json_prefix
from kfp_elastic.etcd.transactions import put_if_absent, unchanged_since
from kfp_elastic.testing.nodes import wait_for

LEASE_TTL = 5  # seconds; every test revokes what it grants, so none waits for an expiry


@pytest.fixture
def prefix(run_id: str) -> str:
    return f"/kfp-elastic-test/{run_id}/"


@pytest.fixture
def leases(client: MultiEndpointEtcd3Client) -> Iterator[list[int]]:
    """Leases the test grants (appended by it); revoked at the end, unless the test did."""
    granted: list[int] = []
    yield granted
    for lease in granted:
        with contextlib.suppress(grpc.RpcError):  # revoked by the test already
            client.revoke_lease(lease)


def _grant(client: MultiEndpointEtcd3Client, leases: list[int]) -> int:
    lease = grant(client, LEASE_TTL)
    leases.append(lease)
    return lease


# -- the election ---------------------------------------------------------------------------


def test_one_candidate_wins_and_the_loser_reads_the_holder(client, prefix, leases) -> None:
    election = LeaderKey(client, prefix + "leader")
    first, second = _grant(client, leases), _grant(client, leases)
    won, _ = election.campaign("a", first, failure=[election.read_op()])
    assert won and election.holder() == b"a"
    lost, responses = election.campaign("b", second, failure=[election.read_op()])
    assert not lost
    assert responses[0][0][0] == b"a"  # the failure branch's read: who holds it
    assert election.holder() == b"a"


def test_campaign_runs_the_callers_compares_and_operations_in_the_same_transaction(
    client, prefix, leases
) -> None:
    election = LeaderKey(client, prefix + "leader")
    lease = _grant(client, leases)
    round_key, record_key = prefix + "round", prefix + "record"
    client.put(round_key, "1")
    _, meta = client.get(round_key)
    client.put(round_key, "2")  # the round moved on since it was read
    won, _ = election.campaign(
        "a",
        lease,
        compare=[unchanged_since(client, round_key, meta.mod_revision)],
        success=[client.transactions.put(record_key, "mine")],
        failure=[client.transactions.put(record_key, "lost")],
    )
    assert not won and election.holder() is None
    assert client.get(record_key)[0] == b"lost"
    _, meta = client.get(round_key)
    won, responses = election.campaign(
        "a",
        lease,
        compare=[unchanged_since(client, round_key, meta.mod_revision)],
        success=[client.transactions.put(record_key, "mine")],
    )
    assert won and election.holder() == b"a" and client.get(record_key)[0] == b"mine"
    assert len(responses) == 2  # the caller's operation first, the claim last


def test_guarded_writes_tell_a_failed_compare_from_a_lost_key(client, prefix, leases) -> None:
    election = LeaderKey(client, prefix + "leader")
    state = prefix + "state"
    lease = _grant(client, leases)
    assert election.campaign("a", lease)[0]
    put = client.transactions.put
    assert election.write("a", [put(state, "1")]) is WriteOutcome.WRITTEN
    assert client.get(state)[0] == b"1"
    stale = unchanged_since(client, state, 0)  # "absent": no longer true
    assert election.write("a", [put(state, "2")], [stale]) is WriteOutcome.REFUSED
    assert election.write("b", [put(state, "3")]) is WriteOutcome.NOT_HOLDER
    client.revoke_lease(lease)  # the holder's lease ends: the key goes with it
    assert election.holder() is None
    assert election.write("a", [put(state, "4")]) is WriteOutcome.NOT_HOLDER
    assert client.get(state)[0] == b"1"


def test_a_handed_on_key_can_be_taken_by_the_next_candidate(client, prefix, leases) -> None:
    election = LeaderKey(client, prefix + "leader")
    first, second = _grant(client, leases), _grant(client, leases)
    assert election.campaign("a", first)[0]
    ok, _ = election.guarded("a", [election.resign_op()])
    assert ok and election.holder() is None
    assert not election.guarded("a", [election.resign_op()])[0]  # no longer the holder
    assert election.campaign("b", second)[0]


def test_a_waiting_candidate_sees_the_vacancy_and_stops_on_request(client, prefix, leases) -> None:
    election = LeaderKey(client, prefix + "leader")
    lease = _grant(client, leases)
    assert election.campaign("a", lease)[0]
    _, meta = client.get(election.key)
    stop = threading.Event()
    stop.set()
    assert not election.wait_until_vacant(meta.mod_revision, stop, deadline=None)
    vacated: list[bool] = []
    waiter = threading.Thread(
        target=lambda: vacated.append(
            election.wait_until_vacant(meta.mod_revision, threading.Event(), deadline=None)
        )
    )
    waiter.start()
    client.revoke_lease(lease)
    waiter.join(30)
    assert vacated == [True]


# -- the guards -------------------------------------------------------------------------------


def test_put_if_absent_keeps_the_first_value(client, prefix, leases) -> None:
    key = prefix + "first"
    assert put_if_absent(client, key, "one")[0]
    created, responses = put_if_absent(client, key, "two", failure=[client.transactions.get(key)])
    assert not created and responses[0][0][0] == b"one"
    assert client.get(key)[0] == b"one"
    lease = _grant(client, leases)
    bound = prefix + "bound"
    assert put_if_absent(client, bound, "x", lease=lease)[0]
    client.revoke_lease(lease)
    assert client.get(bound)[0] is None  # it went with its lease


def test_unchanged_since_is_a_compare_and_swap_on_the_read(client, prefix) -> None:
    key = prefix + "counter"
    tx = client.transactions

    def swap(mod_revision: int, value: str) -> bool:
        compare = [unchanged_since(client, key, mod_revision)]
        return client.transaction(compare=compare, success=[tx.put(key, value)], failure=[])[0]

    assert swap(0, "1")  # read absent, still absent
    assert not swap(0, "x")  # read absent, created since
    _, meta = client.get(key)
    assert swap(meta.mod_revision, "2")
    assert not swap(meta.mod_revision, "y")  # changed since that read
    assert client.get(key)[0] == b"2"


# -- records ----------------------------------------------------------------------------------


def test_records_read_strictly_or_leniently(client, prefix) -> None:
    client.put(prefix + "workers/w0", json.dumps({"phase": "running"}))
    client.put(prefix + "workers/w1", json.dumps({"phase": "failed"}))
    assert read_json(client, prefix + "workers/w0") == {"phase": "running"}
    assert read_json(client, prefix + "nothing") is None
    assert read_json_prefix(client, prefix + "workers/") == {
        "w0": {"phase": "running"},
        "w1": {"phase": "failed"},
    }
    assert decode_json(b"[1, 2]") == [1, 2] and decode_json(None) is None
    with pytest.raises(ValueError):
        decode_json(b"not json")
    assert decode_record(b'{"outcome": "succeeded"}') == {"outcome": "succeeded"}
    for unreadable in (None, b"", b"not json", b"[1, 2]", b'"text"'):
        assert decode_record(unreadable) is None


# -- the lease keeper -------------------------------------------------------------------------


def test_the_keeper_reports_a_lease_that_is_gone(client, leases) -> None:
    lost: list[int] = []
    keeper = LeaseKeeper(client, 0.1, lost.append)
    try:
        kept, revoked = _grant(client, leases), grant(client, LEASE_TTL)
        keeper.keep(kept)
        keeper.keep(revoked)
        assert keeper.refresh_now(revoked)
        client.revoke_lease(revoked)
        wait_for(lambda: lost, 10, what="the revoked lease to be reported")
        assert lost == [revoked]
        assert not keeper.refresh_now(revoked)
        assert keeper.refresh_now(kept)
    finally:
        keeper.stop()
