"""``kfp-elastic etcd --port P`` refuses a port another process listens on, at once, naming it
(another etcd there would answer the health check as if it were ours)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kfp_elastic.etcd.embedded import EmbeddedEtcd, PortInUseError, port_taken
from tests.helpers import REPO_ROOT

REFUSE_WITHIN_S = 60  # a refusal takes about a second; the bound only stops a hang


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_listening_port_is_taken_and_a_closed_one_is_not(listening: int) -> None:
    assert port_taken("127.0.0.1", listening)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert not port_taken("127.0.0.1", free)


def test_start_refuses_a_taken_client_port_without_starting_etcd(listening: int) -> None:
    etcd = EmbeddedEtcd(client_port=listening)
    try:
        with pytest.raises(PortInUseError, match=f"client port {listening} on 127.0.0.1"):
            etcd.start()
        assert etcd.pid is None
    finally:
        etcd.stop()


def test_the_cli_refuses_the_port_of_a_running_etcd(etcd: EmbeddedEtcd) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kfp_elastic", "etcd", "--port", str(etcd.client_port)],
        capture_output=True,
        text=True,
        timeout=REFUSE_WITHIN_S,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"port {etcd.client_port} on 127.0.0.1 is in use by another process" in result.stderr
    assert "ENDPOINT=" not in result.stdout
    assert etcd.healthy()  # the other server is left alone
