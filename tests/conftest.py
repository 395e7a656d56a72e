"""Shared fixtures: a real embedded etcd, unique run ids, handlers that are always shut down."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd
from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler, create_handler

logging.getLogger("kfp_elastic.rendezvous").setLevel(logging.INFO)


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One etcd for the whole session; tests isolate themselves by run id."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, for tests that kill, restart or compact it."""
    with EmbeddedEtcd() as server:
        yield server


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
