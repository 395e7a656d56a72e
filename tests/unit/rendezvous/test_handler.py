"""The elastic-etcd handler against a real etcd, several agents in one process."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from kfp_elastic.contract.failure_budget import read_failures
from kfp_elastic.etcd.watched_prefix import WatchedPrefix
from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler, RunCompletedError
from kfp_elastic.rendezvous.peer_failures import Verdict


def raw_client(etcd) -> MultiEndpointEtcd3Client:
    return MultiEndpointEtcd3Client(
        [Endpoint("127.0.0.1", etcd.client_port, secure=False, time_retry=0.5)],
        timeout=5,
        failover=True,
    )


def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class Joiner:
    """Runs ``next_rendezvous`` in a thread and keeps the result or error."""

    def __init__(self, handler: ElasticEtcdRendezvousHandler) -> None:
        self.handler = handler
        self.info: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.info = self.handler.next_rendezvous()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error

    def result(self, timeout: float = 15.0) -> RendezvousInfo:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "next_rendezvous did not return"
        if self.error:
            raise self.error
        assert self.info is not None
        return self.info


class AgentLoop:
    """Acts like torchrun's agent: rendezvous, then restart whenever num_nodes_waiting() > 0."""

    def __init__(self, handler: ElasticEtcdRendezvousHandler) -> None:
        self.handler = handler
        self.info: RendezvousInfo | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.info = self.handler.next_rendezvous()
            except Exception:  # noqa: BLE001 - left or closed: stop like an agent would
                return
            while not self._stop.wait(0.05) and self.handler.num_nodes_waiting() == 0:
                pass

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def crash(handler: ElasticEtcdRendezvousHandler) -> None:
    """Stop a handler like a SIGKILL would: no revoke, its sockets closed, no more refreshes."""
    membership = handler._membership
    membership._left = True
    membership._keeper.stop()
    membership._cache.stop()
    if membership._probe is not None:
        membership._probe.stop()
    handler._left.set()


def join_all(handlers: list[ElasticEtcdRendezvousHandler], stagger: float = 0.0) -> list:
    joiners = []
    for handler in handlers:
        joiners.append(Joiner(handler))
        time.sleep(stagger)
    return [j.result() for j in joiners]


def test_first_round_forms_after_last_call_with_ranks_in_join_order(make_handler) -> None:
    handlers = [make_handler(2, 3, last_call_timeout=0.5) for _ in range(2)]
    infos = join_all(handlers, stagger=0.3)
    assert [i.rank for i in infos] == [0, 1]
    assert {i.world_size for i in infos} == {2}
    ports = {i.bootstrap_store_info.master_port for i in infos}
    assert len(ports) == 1  # every node got the same MASTER_PORT through the etcd store


def test_max_nodes_form_at_once_without_last_call(make_handler) -> None:
    handlers = [make_handler(1, 2, last_call_timeout=60) for _ in range(2)]
    infos = join_all(handlers)
    assert sorted(i.rank for i in infos) == [0, 1]


def test_nodes_past_max_wait_and_fill_a_freed_place(make_handler) -> None:
    a, b, c = (make_handler(1, 2, last_call_timeout=0.3) for _ in range(3))
    infos = join_all([a, b], stagger=0.1)
    assert [i.world_size for i in infos] == [2, 2]
    spare = Joiner(c)
    time.sleep(1.0)
    assert spare.thread.is_alive()  # on the redundancy list
    assert a.num_nodes_waiting() == 0  # a full round is not disturbed by a spare
    b.leave("test")
    assert eventually(lambda: a.num_nodes_waiting() > 0)
    joiner_a = Joiner(a)
    info_a, info_c = joiner_a.result(), spare.result()
    assert (info_a.world_size, info_c.world_size) == (2, 2)
    assert {info_a.rank, info_c.rank} == {0, 1}


def test_newcomer_below_max_makes_members_restart(make_handler) -> None:
    a, b = (make_handler(1, 3, last_call_timeout=0.3) for _ in range(2))
    join_all([a, b], stagger=0.1)
    c = make_handler(1, 3, last_call_timeout=0.3)
    newcomer = Joiner(c)
    assert eventually(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1)
    joiners = [Joiner(a), Joiner(b), newcomer]
    infos = [j.result() for j in joiners]
    assert [i.world_size for i in infos] == [3, 3, 3]
    assert [i.rank for i in infos] == [0, 1, 2]  # survivors keep their places


def test_dead_peer_detected_by_lease_expiry(make_handler) -> None:
    a, b = (make_handler(1, 2, lease_ttl=2, peer_probe="false") for _ in range(2))
    join_all([a, b], stagger=0.1)
    crash(b)
    assert a.num_nodes_waiting() == 0
    assert eventually(lambda: a.num_nodes_waiting() == 1, timeout=10)
    info = Joiner(a).result()
    assert (info.rank, info.world_size) == (0, 1)


def test_dead_peer_detected_by_probe_before_lease_expiry(make_handler) -> None:
    a, b = (make_handler(1, 2, lease_ttl=60) for _ in range(2))
    join_all([a, b], stagger=0.1)
    crash(b)
    # The 60 s lease is still valid: only the closed probe connection can tell a.
    assert eventually(lambda: a.num_nodes_waiting() == 1, timeout=10)


def test_graceful_leave_is_seen_at_once(make_handler) -> None:
    a, b = (make_handler(1, 2, lease_ttl=60, peer_probe="false") for _ in range(2))
    join_all([a, b], stagger=0.1)
    b.leave("SIGTERM")
    assert eventually(lambda: a.num_nodes_waiting() == 1, timeout=10)


def test_first_node_can_die(make_handler) -> None:
    a, b, c = (make_handler(2, 3, lease_ttl=60) for _ in range(3))
    join_all([a, b, c], stagger=0.1)
    crash(a)  # the earliest registered node: rank 0 and leader
    assert eventually(lambda: b.num_nodes_waiting() > 0 and c.num_nodes_waiting() > 0)
    infos = [Joiner(b), Joiner(c)]
    assert sorted(j.result().rank for j in infos) == [0, 1]


def test_keys_are_json_under_the_run_prefix(make_handler, etcd, run_id) -> None:
    a, b = (make_handler(1, 2) for _ in range(2))
    join_all([a, b])
    client = raw_client(etcd)
    try:
        entries = {m.key.decode(): v for v, m in client.get_prefix(f"/kfp-elastic/{run_id}/")}
    finally:
        client.close()
    rdzv = {k: v for k, v in entries.items() if "/rdzv/" in k}
    assert f"/kfp-elastic/{run_id}/rdzv/round" in rdzv
    assert sum("/rdzv/nodes/" in k for k in rdzv) == 2
    for value in rdzv.values():
        json.loads(value)  # every record of ours is JSON
    round_record = json.loads(rdzv[f"/kfp-elastic/{run_id}/rdzv/round"])
    assert round_record["round"] == 1 and len(round_record["participants"]) == 2
    assert any(k.startswith(f"/kfp-elastic/{run_id}/store/1/") for k in entries)


def test_stale_round_write_loses_the_compare_and_swap(make_handler) -> None:
    a = make_handler(1, 1)
    info = Joiner(a).result()
    _, current = a._membership.view()
    stale = type(current)(current.number - 1, current.participants)
    assert not a._membership.form_round(stale, current.participants)
    _, after = a._membership.view()
    assert after.number == current.number and info.rank == 0


def test_set_closed_stops_everyone(make_handler) -> None:
    a, b = (make_handler(1, 2) for _ in range(2))
    join_all([a, b])
    a.set_closed()
    assert eventually(b.is_closed)
    with pytest.raises(RendezvousClosedError) as closed:
        b.next_rendezvous()
    assert not isinstance(closed.value, RunCompletedError)  # nobody said the job succeeded


def test_a_node_arriving_after_success_learns_the_run_completed(make_handler) -> None:
    a, b = (make_handler(1, 2) for _ in range(2))
    join_all([a, b])
    a.shutdown()  # no exception in flight: torchrun's shutdown after the workers succeeded
    late = make_handler(1, 2)
    assert eventually(late.is_closed)
    with pytest.raises(RunCompletedError, match="completed before node"):
        late.next_rendezvous()


def test_an_agent_giving_up_with_close_on_failure_does_not_complete_the_run(make_handler) -> None:
    a = make_handler(1, 1, close_on_failure=True)
    Joiner(a).result()
    try:
        raise RuntimeError("workers failed")
    except RuntimeError:
        a.shutdown()  # torchrun's shutdown in launch_agent's finally, the error in flight
    late = make_handler(1, 1)
    assert eventually(late.is_closed)
    with pytest.raises(RendezvousClosedError) as closed:
        late.next_rendezvous()
    assert not isinstance(closed.value, RunCompletedError)


def test_join_timeout_raises_instead_of_hanging(make_handler) -> None:
    lonely = make_handler(2, 2, join_timeout=1)
    with pytest.raises(RendezvousTimeoutError, match="join_timeout=1.0s"):
        Joiner(lonely).result(timeout=10)


def test_every_key_is_gone_after_the_job(make_handler, etcd, run_id) -> None:
    a, b = (make_handler(1, 2, close_timeout=2) for _ in range(2))
    join_all([a, b])
    a.shutdown()
    b.shutdown()
    client = raw_client(etcd)
    try:
        assert eventually(lambda: not list(client.get_prefix(f"/kfp-elastic/{run_id}/")), 15)
    finally:
        client.close()


def test_node_whose_lease_was_revoked_rejoins(make_handler, etcd) -> None:
    a, b = (make_handler(1, 2, peer_probe="false") for _ in range(2))
    join_all([a, b])
    assert a._round.number == 1
    client = raw_client(etcd)
    try:
        client.revoke_lease(b._membership._node_lease)
    finally:
        client.close()
    loops = [AgentLoop(a), AgentLoop(b)]
    # Round 2 may hold a alone (b re-joins in round 3) or both, if b re-registered in time.
    try:
        assert eventually(
            lambda: (
                all(loop.info and loop.info.world_size == 2 for loop in loops)
                and a._round.number >= 2
                and a._round == b._round
            ),
            15,
        )
    finally:
        for loop in loops:
            loop.stop()


def test_watch_resumes_after_compaction(private_etcd) -> None:
    client = raw_client(private_etcd)
    try:
        client.put("/c/a", "1")
        first = client.put("/c/b", "2").header.revision
        client.put("/c/a", "3")
        latest = client.put("/c/z", "4").header.revision
        client.compact(latest)
        cache = WatchedPrefix(client, "/c/")
        cache.start(start_revision=first)  # already compacted away
        client.put("/c/after", "5")
        assert eventually(lambda: cache.get("/c/after") is not None)
        assert cache.get("/c/a").value == b"3"
        cache.stop()
    finally:
        client.close()


def test_watch_resumes_after_etcd_restart(private_etcd) -> None:
    client = raw_client(private_etcd)
    try:
        cache = WatchedPrefix(client, "/r/")
        cache.start()
        client.put("/r/before", "1")
        assert eventually(lambda: cache.get("/r/before") is not None)
        private_etcd.restart()
        assert eventually(lambda: _put_ok(client, "/r/after"), 15)
        assert eventually(lambda: cache.get("/r/after") is not None, 15)
        assert cache.resync_count >= 1
        cache.stop()
    finally:
        client.close()


def _put_ok(client: MultiEndpointEtcd3Client, key: str) -> bool:
    try:
        client.put(key, "1")
        return True
    except Exception:  # noqa: BLE001 - etcd still starting
        return False


def test_failing_agent_leaves_without_closing_the_run(make_handler) -> None:
    a, b = (make_handler(1, 2) for _ in range(2))
    join_all([a, b])
    try:
        raise RuntimeError("workers failed, restarts spent")
    except RuntimeError:
        assert a.shutdown()  # torchrun calls it from a finally block while the error flies
    assert eventually(lambda: b.num_nodes_waiting() == 1)
    assert not b.is_closed()
    assert Joiner(b).result().world_size == 1


def test_cache_reports_the_keys_changed_since_a_position(private_etcd, monkeypatch) -> None:
    monkeypatch.setattr("kfp_elastic.etcd.watched_prefix.CHANGE_LOG_SIZE", 4)
    client = raw_client(private_etcd)
    try:
        cache = WatchedPrefix(client, "/l/")
        client.put("/l/old", "0")
        cache.start()
        start = cache.position
        client.put("/l/a", "1")
        client.put("/l/b", "2")
        last = client.delete("/l/old") and client.put("/l/a", "3").header.revision
        assert eventually(lambda: cache.revision >= last)
        position, changed = cache.changes_since(start)
        assert position == cache.position > start
        assert changed == {"/l/a": cache.get("/l/a"), "/l/b": cache.get("/l/b"), "/l/old": None}
        assert cache.changes_since(position) == (position, {})
        for index in range(5):  # more changes than the log keeps: the reader must re-read
            last = client.put(f"/l/k{index}", "x").header.revision
        assert eventually(lambda: cache.revision >= last)
        assert cache.changes_since(start)[1] is None
        cache.stop()
    finally:
        client.close()


def test_a_narrowed_cache_follows_only_its_ranges_and_widens(private_etcd) -> None:
    client = raw_client(private_etcd)
    try:
        client.put("/n/nodes/other", "1")
        client.put("/n/nodes/me", "1")
        client.put("/n/round", "1")
        cache = WatchedPrefix(client, "/n/", hidden="/n/nodes/", shown="/n/nodes/me")
        cache.start()
        assert cache.narrow
        assert set(cache.snapshot()[1]) == {"/n/nodes/me", "/n/round"}
        client.put("/n/nodes/late", "2")  # hidden: never seen while narrowed
        client.put("/n/closed", "3")
        last = client.put("/n/nodes/me", "4").header.revision
        assert cache.wait_for_key("/n/nodes/me", last, 5)
        assert eventually(lambda: cache.get("/n/closed") is not None)
        assert cache.get("/n/nodes/late") is None
        before = cache.position
        cache.set_narrow(False)  # one read: every key, then every change
        assert not cache.narrow and cache.changes_since(before)[1] is None
        assert cache.get("/n/nodes/late") is not None and cache.get("/n/nodes/other")
        client.put("/n/nodes/newest", "5")
        assert eventually(lambda: cache.get("/n/nodes/newest") is not None)
        cache.set_narrow(True)
        assert cache.get("/n/nodes/other") is None and cache.get("/n/round") is not None
        cache.stop()
    finally:
        client.close()


def test_a_round_larger_than_etcds_transaction_limit_forms(make_handler) -> None:
    # etcd refuses a transaction of more than --max-txn-ops (128) compares: a round of 130
    # once never formed because its write compared every participant's key.
    size = 130
    handlers = [make_handler(size, size, peer_probe="false") for _ in range(size)]
    joiners = [Joiner(handler) for handler in handlers]
    infos = [joiner.result(timeout=60) for joiner in joiners]
    assert sorted(info.rank for info in infos) == list(range(size))
    assert {info.world_size for info in infos} == {size}


def test_a_spare_keeps_the_run_alive_after_every_member_left(make_handler, etcd, run_id) -> None:
    # Members gone longer than close_timeout while a spare waits for MIN: the round record
    # must survive (the spare keeps the run lease), and the next round admits the spare.
    a, b, spare = (make_handler(2, 2, close_timeout=2, last_call_timeout=0.2) for _ in range(3))
    join_all([a, b])
    waiting = Joiner(spare)
    time.sleep(0.5)
    a.leave("test")
    b.leave("test")
    time.sleep(4)  # two close_timeouts
    client = raw_client(etcd)
    try:
        value, _ = client.get(f"/kfp-elastic/{run_id}/rdzv/round")
        assert value is not None and json.loads(value)["round"] >= 1
    finally:
        client.close()
    newcomer = make_handler(2, 2, close_timeout=2, last_call_timeout=0.2)
    joining = Joiner(newcomer)
    infos = [waiting.result(), joining.result()]
    assert sorted(i.rank for i in infos) == [0, 1]


def test_a_vanished_round_record_restarts_numbering_past_every_waiter(
    make_handler, etcd, run_id
) -> None:
    a = make_handler(1, 1)
    for _ in range(3):  # rounds 1..3
        Joiner(a).result()
    client = raw_client(etcd)
    try:
        client.delete(f"/kfp-elastic/{run_id}/rdzv/round")  # as if its lease had expired
    finally:
        client.close()
    Joiner(a).result()
    _, current = a._membership.view()
    assert current.number == 4  # at once past after_round=3, not rounds 1, 2, 3 again


def _leader_of(handler: ElasticEtcdRendezvousHandler) -> str | None:
    leader = handler._membership.status().leader
    return leader.node_id if leader else None


def test_waiting_nodes_follow_only_their_own_record_until_they_lead_or_join(make_handler) -> None:
    # N nodes each following all N registrations cost N^2 watch events; a waiter that does
    # not lead follows only its own record and the round/leader/closed keys.
    a, b = (make_handler(3, 3) for _ in range(2))
    joiners = [Joiner(a), Joiner(b)]
    assert eventually(lambda: _leader_of(a) is not None and _leader_of(a) == _leader_of(b))
    leader, waiter = (a, b) if _leader_of(a) == a.node_id else (b, a)
    assert eventually(lambda: len(leader._membership.view()[0]) == 2)
    assert leader._membership.follows_all
    assert not waiter._membership.follows_all
    assert [n.node_id for n in waiter._membership.view()[0]] == [waiter.node_id]
    c = make_handler(3, 3)
    infos = [j.result() for j in [*joiners, Joiner(c)]]
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    # Members follow everyone again (num_nodes_waiting; read on the cache's thread once
    # next_rendezvous returned), and nobody holds the leader key.
    assert eventually(lambda: all(h._membership.follows_all for h in (a, b, c)))
    assert all(len(h._membership.view()[0]) == 3 for h in (a, b, c))
    assert eventually(lambda: all(_leader_of(h) is None for h in (a, b, c)))
    assert all(h.num_nodes_waiting() == 0 for h in (a, b, c))


def test_a_dead_leader_is_replaced_before_its_lease_expires(make_handler) -> None:
    a, b = (make_handler(3, 3, lease_ttl=60) for _ in range(2))
    joiners = {a.node_id: Joiner(a), b.node_id: Joiner(b)}
    assert eventually(lambda: _leader_of(a) is not None and _leader_of(a) == _leader_of(b))
    leader, survivor = (a, b) if _leader_of(a) == a.node_id else (b, a)
    probe = survivor._membership._probe
    assert probe is not None
    assert eventually(lambda: leader.node_id in probe._watched)  # connected before the crash
    crash(leader)
    # The 60 s lease is still valid: only the waiters' probe of the leader can tell.
    assert eventually(lambda: _leader_of(survivor) == survivor.node_id, timeout=10)
    c, d = make_handler(3, 3, lease_ttl=60), make_handler(3, 3, lease_ttl=60)
    late = [Joiner(c), Joiner(d)]
    infos = [joiners[survivor.node_id].result(), *(j.result() for j in late)]
    assert sorted(i.rank for i in infos) == [0, 1, 2]


def test_a_spare_takes_the_leader_key_and_forms_the_next_round(make_handler) -> None:
    a, b, spare = (make_handler(2, 2, last_call_timeout=0.2) for _ in range(3))
    join_all([a, b])
    waiting = Joiner(spare)
    assert eventually(lambda: _leader_of(spare) == spare.node_id)  # nobody else waits
    assert a.num_nodes_waiting() == 0  # past MAX: the full round is not disturbed
    b.leave("test")
    assert eventually(lambda: a.num_nodes_waiting() > 0)
    infos = [Joiner(a).result(), waiting.result()]
    assert sorted(i.rank for i in infos) == [0, 1]


def test_rank0_that_does_not_lead_publishes_the_bootstrap_address(make_handler) -> None:
    # Round 1: a leads and is rank 0 (MASTER_ADDR/PORT written with the round). Round 2: the
    # newcomer c leads (it waited first), a is rank 0 and publishes them itself.
    # A last call long enough that a loaded machine starts all three joiners within it (the
    # second round closes at once when the third joins: max_nodes=3).
    a, b = (make_handler(1, 3, last_call_timeout=1.5) for _ in range(2))
    first = join_all([a, b], stagger=0.1)
    assert len({i.bootstrap_store_info.master_port for i in first}) == 1
    c = make_handler(1, 3, last_call_timeout=1.5)
    newcomer = Joiner(c)
    assert eventually(lambda: _leader_of(c) == c.node_id)
    infos = [j.result() for j in [Joiner(a), Joiner(b), newcomer]]
    assert [i.rank for i in infos] == [0, 1, 2]
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos
            }
        )
        == 1
    )
    master = a._membership.master(2)
    assert master is not None and master.node_id == a.node_id
    assert infos[0].store.get("MASTER_PORT") == str(master.port).encode()  # torch's keys too


def test_rank0_dying_before_it_publishes_the_bootstrap_address(make_handler) -> None:
    # The others wait for rank 0's MASTER_ADDR/PORT; its death breaks the round and they
    # form the next one instead of waiting for the 300 s store timeout.
    a, b = (make_handler(1, 3, last_call_timeout=0.3, lease_ttl=60) for _ in range(2))
    join_all([a, b], stagger=0.1)
    c = make_handler(1, 3, last_call_timeout=0.3, lease_ttl=60)
    newcomer = Joiner(c)
    assert eventually(lambda: _leader_of(c) == c.node_id)  # so a, rank 0, does not lead

    def die(current: object) -> None:
        crash(a)
        raise RuntimeError("killed before publishing MASTER_ADDR")

    a._membership.publish_master = die  # type: ignore[method-assign]
    dying = Joiner(a)
    infos = [j.result(timeout=30) for j in [Joiner(b), newcomer]]
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    assert isinstance(dying.error, RuntimeError)


def test_store_timeout_bounds_the_rounds_store(make_handler) -> None:
    handler = make_handler(1, 1, store_timeout=7)
    info = handler.next_rendezvous()
    assert info.store.timeout == timedelta(seconds=7)


@dataclasses.dataclass
class ProcessFailure:  # what torchrun's agent hands to on_worker_failure, per global rank
    exitcode: int
    message: str
    timestamp: int = 0


GLOO_PEER = "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:4711"


def test_a_rounds_failure_counts_once_in_the_jobs_budget_until_it_is_spent(
    make_handler, etcd, run_id
) -> None:
    """One rank's error fails its peer's workers in the same round: two agents report it, the
    job's budget counts it once (with the rank's own error); the next round's failure spends a
    budget of 1, and the agent stops restarting in place."""
    a, b = (make_handler(2, 2, peer_failure_grace=0, max_failures=1) for _ in range(2))
    join_all([a, b])
    own = {1: ProcessFailure(1, "RuntimeError: a data-dependent error at step 3")}
    assert a.on_worker_failure({0: ProcessFailure(1, GLOO_PEER)}) == Verdict.COUNT
    assert b.on_worker_failure(own) == Verdict.COUNT
    client = raw_client(etcd)
    prefix = a._config.run_prefix
    (counted,) = read_failures(client, prefix)
    assert counted.error.startswith("RuntimeError: a data-dependent error at step 3 (rank 1,")
    assert (counted.node, counted.rank, counted.source) == (b.node_id, 1, "agent")
    join_all([a, b])  # torchrun restarts both in place: the next round
    moved = {1: ProcessFailure(1, "RuntimeError: a data-dependent error at step 4")}
    assert b.on_worker_failure(moved) == Verdict.GIVE_UP  # 2 > max_failures=1
    assert len(read_failures(client, prefix)) == 2
    client.close()


def test_a_non_finite_loss_is_never_restarted_in_place(make_handler, etcd) -> None:
    """Even without a budget (a torchrun job without a master): a fatal error at once."""
    handler = make_handler(1, 1, peer_failure_grace=0)
    join_all([handler])
    nan = "NonFiniteLoss: non-finite loss (nan) at step 7 on rank 0: training stopped"
    assert handler.on_worker_failure({0: ProcessFailure(1, nan)}) == Verdict.GIVE_UP
    client = raw_client(etcd)
    (counted,) = read_failures(client, handler._config.run_prefix)
    client.close()
    assert counted.fatal and counted.error.startswith(nan)
