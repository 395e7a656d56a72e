"""The backend registers through the torchrun.handlers entry point, whatever was imported first."""

import subprocess
import sys

import pytest

CHECK = (
    "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
    "assert 'elastic-etcd' in r._registry, sorted(r._registry)"
)


@pytest.mark.parametrize("first", ["", "import rendezvous.handler;", "import rendezvous;"])
def test_entry_point_registers_the_backend(first: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", first + CHECK], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "Exception while registering" not in result.stderr
