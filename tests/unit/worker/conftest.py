"""Fixtures of the worker tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from kfp_elastic.etcd.embedded import EmbeddedEtcd, free_port


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A Gloo process group of one in the test process; the SIGTERM handler restored after."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def etcd_env(etcd: EmbeddedEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The etcd connection and run id in the environment, as torchrun gives a worker."""
    for name, value in etcd.client_settings().to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
