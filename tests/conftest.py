"""Shared fixtures: a real embedded etcd (plain, or with TLS + client certificates + user/password
auth), unique run ids, handlers that are always shut down, a process marker for kfp.local runs,
and the test cluster (API server + scheduler + kubelets running pods as local processes)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from pyetcd.client import MultiEndpointEtcd3Client
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kfp_elastic.components.common import reap_local_processes
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.etcd.pki import generate_test_pki
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.pipelines.run_local import SESSION_ENV
from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler, create_handler
from kfp_elastic.testing.cluster import FAST_NODE_LIFECYCLE, TestCluster

logging.getLogger("kfp_elastic.rendezvous").setLevel(logging.INFO)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Code that runs in the test process may set variables for the processes it starts (the
    rendezvous handler sets the round and NCCL's error handling for its workers): undo them, so
    that no later test's subprocess inherits them."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One etcd for the whole session; tests isolate themselves by run id."""
    with EmbeddedEtcd() as server:
        yield server


@dataclass(frozen=True)
class SecureEtcd:
    """An etcd that demands TLS, a client certificate and a user with a password."""

    server: EmbeddedEtcd
    settings: EtcdSettings  # https endpoint, CA, client cert/key, user, password file
    password: str  # what must never show on a command line


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """One secured etcd for the session; its user may only use the default key prefix."""
    directory = tmp_path_factory.mktemp("secure-etcd")
    pki = generate_test_pki(directory / "pki")
    password = f"pw-{uuid.uuid4().hex}"
    password_file = directory / "trainer.password"
    password_file.write_text(password + "\n")
    with EmbeddedEtcd(tls=pki.server) as server:
        server.enable_auth(f"root-{uuid.uuid4().hex}")
        server.add_user("trainer", password, key_prefix="/kfp-elastic/")
        settings = server.client_settings(
            cert=str(pki.client_cert),
            key=str(pki.client_key),
            user="trainer",
            password_file=str(password_file),
        )
        yield SecureEtcd(server, settings, password)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every process a kfp.local run starts inherits this marker; none may be left at the end."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(SESSION_ENV, value)
    yield value
    left = reap_local_processes(value, env=SESSION_ENV, grace_s=5)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, for tests that kill, restart or compact it."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def client(etcd: EmbeddedEtcd) -> Iterator[MultiEndpointEtcd3Client]:
    """A client of the shared etcd, closed after the test."""
    c = connect(etcd.client_settings())
    yield c
    c.close()


@pytest.fixture
def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


HandlerFactory = Callable[..., ElasticEtcdRendezvousHandler]


@pytest.fixture
def make_handler(etcd: EmbeddedEtcd, run_id: str) -> Iterator[HandlerFactory]:
    """``make_handler(min, max, endpoint=None, **conf)``; every handler made is shut down."""
    made: list[ElasticEtcdRendezvousHandler] = []

    def make(
        min_nodes: int = 1,
        max_nodes: int = 1,
        endpoint: str | None = None,
        run: str | None = None,
        **conf: object,
    ) -> ElasticEtcdRendezvousHandler:
        conf.setdefault("last_call_timeout", "0.5")
        params = RendezvousParameters(
            "elastic-etcd",
            endpoint or etcd.endpoint,
            run or run_id,
            min_nodes,
            max_nodes,
            local_addr="127.0.0.1",
            **{k: str(v) for k, v in conf.items()},
        )
        handler = create_handler(params)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.leave("test teardown")


@pytest.fixture
def test_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    """One node (2 CPUs, 4 GiB); tests add, resize and remove nodes (a lost node's pods go within
    seconds: ``FAST_NODE_LIFECYCLE``). Nothing any pod started may outlive it."""
    with TestCluster(
        tmp_path_factory.mktemp("cluster"),
        nodes={"node-1": {"cpu": "2", "memory": "4Gi"}},
        node_lifecycle=FAST_NODE_LIFECYCLE,
    ) as cluster:
        yield cluster
    left = cluster.leftover_processes()
    assert not left, f"test cluster processes left running: {left}"
