"""EtcdStore against a real etcd, checked side by side with torch's own TCPStore semantics."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from kfp_elastic.etcd.embedded import EmbeddedEtcd, free_port
from kfp_elastic.rendezvous.store import EtcdStore, RoundBrokenError


@pytest.fixture
def client(etcd: EmbeddedEtcd):
    c = MultiEndpointEtcd3Client(
        [Endpoint("127.0.0.1", etcd.client_port, secure=False, time_retry=0.5)],
        timeout=5,
        failover=True,
    )
    yield c
    c.close()


@pytest.fixture
def store(client, run_id: str) -> EtcdStore:
    return EtcdStore(client, f"/kfp-elastic/{run_id}/store/1/", timeout=timedelta(seconds=5))


@pytest.fixture
def tcp_store():
    return dist.TCPStore(
        "127.0.0.1", free_port(), 1, True, timedelta(seconds=5), wait_for_workers=False
    )


def test_set_get_and_raw_bytes(store: EtcdStore, client) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"
    value, _ = client.get(store.prefix + "b")
    assert value == b"\x00\xffbin"  # stored as given, no pickle or wrapper


def test_blocking_get_wakes_on_a_later_set(store: EtcdStore) -> None:
    threading.Timer(0.3, store.set, args=("late", "v")).start()
    assert store.get("late") == b"v"


def test_get_times_out_with_a_clear_error(store: EtcdStore) -> None:
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match=r"keys \['never'\].*not set within 1s"):
        store.get("never")


def test_wait_aborts_when_round_breaks(client, run_id: str) -> None:
    broken = threading.Event()
    store = EtcdStore(client, f"/kfp-elastic/{run_id}/store/2/", abort_if=broken.is_set)
    threading.Timer(0.3, broken.set).start()
    with pytest.raises(RoundBrokenError, match="broke"):  # a DistStoreError: torch's own type
        store.multi_get(["never"])


@pytest.mark.parametrize("impl", ["etcd", "tcp"])
def test_same_semantics_as_tcpstore(impl: str, store: EtcdStore, tcp_store) -> None:
    s = store if impl == "etcd" else tcp_store
    assert s.add("counter", 2) == 2
    assert s.add("counter", 3) == 5
    assert s.get("counter") == b"5"
    assert s.compare_set("cs", "", "first") == b"first"
    assert s.compare_set("cs", "wrong", "x") == b"first"
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.compare_set("missing", "expected", "x") == b"expected"
    s.set("k1", "v1")
    s.multi_set(["k2", "k3"], ["v2", "v3"])
    assert s.multi_get(["k1", "k2", "k3"]) == [b"v1", b"v2", b"v3"]
    assert s.check(["k1", "k2"]) and not s.check(["k1", "nope"])
    s.wait(["k1", "k3"])
    assert s.delete_key("k1") and not s.delete_key("k1")
    assert s.num_keys() >= 4  # TCPStore also counts its own bookkeeping key
    if impl == "etcd":
        assert s.num_keys() == 4


def test_concurrent_adds_are_atomic(store: EtcdStore) -> None:
    def add_many() -> None:
        for _ in range(20):
            store.add("n", 1)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert store.get("n") == b"80"


def test_rounds_are_namespaced(client, run_id: str) -> None:
    old = EtcdStore(client, f"/kfp-elastic/{run_id}/store/1/")
    new = EtcdStore(client, f"/kfp-elastic/{run_id}/store/2/")
    old.set("MASTER_PORT", "1111")
    new.set("MASTER_PORT", "2222")
    old.set("MASTER_PORT", "3333")  # a late writer of round 1
    assert new.get("MASTER_PORT") == b"2222"


def test_torch_barrier_runs_on_the_store(client, run_id: str) -> None:
    from torch.distributed.elastic.utils import store as store_util

    stores = [EtcdStore(client, f"/kfp-elastic/{run_id}/store/9/") for _ in range(3)]
    started = time.monotonic()
    threads = [
        threading.Thread(target=store_util.barrier, args=(s, 3, "exit/", 10)) for s in stores
    ]
    [t.start() for t in threads]
    [t.join(15) for t in threads]
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - started < 10


def test_the_exit_barrier_is_torchs() -> None:
    from torch.distributed.elastic.agent.server import api

    from kfp_elastic.rendezvous.store import EXIT_BARRIER_PREFIX

    assert EXIT_BARRIER_PREFIX == api._TERMINAL_STATE_SYNC_ID


def test_the_exit_barrier_is_bounded_and_names_who_did_not_finish(client, run_id: str) -> None:
    """torch's own exit barrier (300 s) on our store: a node that finished gives up after
    exit_barrier_timeout and names the node whose workers never ended."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import barrier

    from kfp_elastic.rendezvous.store import ExitBarrier

    prefix = f"/kfp-elastic/{run_id}/store/3/"
    round_nodes = ("node-a", "node-b", "node-c")
    stores = {
        node: EtcdStore(client, prefix, exit_barrier=ExitBarrier(node, round_nodes, 1.0))
        for node in round_nodes
    }
    errors: dict[str, BaseException] = {}

    def finish(node: str) -> None:
        try:
            barrier(stores[node], 3, _TERMINAL_STATE_SYNC_ID, barrier_timeout=300)
        except BaseException as error:  # noqa: BLE001
            errors[node] = error

    threads = [threading.Thread(target=finish, args=(n,)) for n in ("node-a", "node-c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)  # far below torch's 300 s: the bound is ours
    assert not any(thread.is_alive() for thread in threads)
    for node in ("node-a", "node-c"):
        message = str(errors[node])
        assert "node-b" in message and "exit_barrier_timeout=1s" in message
        assert "node-a" not in message.split("node(s)")[1].split("did not")[0]


def test_the_exit_barrier_passes_when_every_node_finished(client, run_id: str) -> None:
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import barrier

    from kfp_elastic.rendezvous.store import ExitBarrier

    prefix = f"/kfp-elastic/{run_id}/store/4/"
    nodes = ("node-a", "node-b")
    stores = [EtcdStore(client, prefix, exit_barrier=ExitBarrier(n, nodes, 5.0)) for n in nodes]
    passed: list[EtcdStore] = []
    threads = [
        threading.Thread(
            target=lambda s=s: (barrier(s, 2, _TERMINAL_STATE_SYNC_ID, 300), passed.append(s))
        )
        for s in stores
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(passed) == 2
