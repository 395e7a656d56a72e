"""Fast detection of a dead peer: a TCP connection that closes when the peer's process dies.

Every node listens on a probe port and holds connections to its next ``fanout`` nodes on the
ring of live nodes (registration order). A peer process that dies, even by SIGKILL, has its
sockets closed by its kernel at once, so the watcher sees EOF in milliseconds and revokes the
peer's lease; survivors then re-form without waiting for the lease TTL. A host that vanishes
without closing sockets (power loss, partition) is still caught by the lease TTL. Connections
that merely time out are never taken as death.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kfp_elastic.contract.rendezvous_config import PROBE_CONNECT_TIMEOUT_S

log = logging.getLogger(__name__)

# How long a probe waits for a peer's listener by default (``--rdzv-conf probe_connect_timeout``);
# the probe ring's caller is not held up longer.
CONNECT_TIMEOUT_S = PROBE_CONNECT_TIMEOUT_S
# The watch thread wakes at least this often to see ``stop``; ``stop`` also wakes it through a
# socket, so this only bounds a missed wake-up.
STOP_CHECK_S = 1.0
# How long ``stop`` waits for the watch thread (a daemon: it never holds the process).
STOP_JOIN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ProbeTarget:
    node_id: str
    address: str  # "host:port"
    lease: int


def ring_successors(order: Sequence[str], me: str, fanout: int) -> list[str]:
    """The ``fanout`` nodes after ``me`` on the ring ``order`` (pure)."""
    if me not in order or len(order) < 2:
        return []
    index = order.index(me)
    count = min(fanout, len(order) - 1)
    return [order[(index + step) % len(order)] for step in range(1, count + 1)]


class PeerProbe:
    def __init__(
        self,
        bind_host: str,
        on_dead: Callable[[ProbeTarget], None],
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self._on_dead = on_dead
        self.connect_timeout = connect_timeout
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.address = f"{bind_host}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, ("accept", None))
        self._watched: dict[str, tuple[socket.socket, ProbeTarget]] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peer-probe")
        self._thread.start()

    def watch(self, targets: Sequence[ProbeTarget]) -> None:
        """Hold connections to exactly these targets (connecting outside the lock)."""
        wanted = {t.node_id: t for t in targets}
        with self._lock:
            stale = [n for n, (_, t) in self._watched.items() if wanted.get(n) != t]
            for node_id in stale:
                self._drop(node_id)
            new = [t for n, t in wanted.items() if n not in self._watched]
        for target in new:
            self._connect(target)

    def _connect(self, target: ProbeTarget) -> None:
        host, _, port = target.address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), self.connect_timeout)
        except ConnectionRefusedError:
            # Listening starts before registration, so refused means the process is gone.
            log.warning("probe refused, peer gone node=%s", target.node_id)
            self._on_dead(target)
            return
        except OSError as error:
            log.info("probe unreachable, relying on lease node=%s error=%r", target.node_id, error)
            return
        sock.setblocking(False)
        with self._lock:
            if target.node_id in self._watched or self._stopped.is_set():
                sock.close()
                return
            self._watched[target.node_id] = (sock, target)
            self._selector.register(sock, selectors.EVENT_READ, ("peer", target))
        self._wake_w.send(b"x")

    def _drop(self, node_id: str) -> None:
        sock, _ = self._watched.pop(node_id)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=STOP_JOIN_TIMEOUT_S)
        with self._lock:
            for node_id in list(self._watched):
                self._drop(node_id)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def _run(self) -> None:
        accepted: list[socket.socket] = []
        while not self._stopped.is_set():
            for key, _ in self._selector.select(timeout=STOP_CHECK_S):
                kind, target = key.data
                if kind == "accept":
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        accepted.append(conn)  # held open: our being alive is the signal
                        self._selector.register(conn, selectors.EVENT_READ, ("inbound", None))
                elif kind == "wake":
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                elif kind == "inbound":
                    self._drain_inbound(key.fileobj, accepted)  # type: ignore[arg-type]
                else:
                    self._check_peer(key.fileobj, target)  # type: ignore[arg-type]
        for conn in accepted:
            conn.close()

    def _drain_inbound(self, conn: socket.socket, accepted: list[socket.socket]) -> None:
        try:
            if conn.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._selector.unregister(conn)
        accepted.remove(conn)
        conn.close()

    def _check_peer(self, sock: socket.socket, target: ProbeTarget) -> None:
        try:
            if sock.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError as error:
            if error.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
                log.info("probe error, relying on lease node=%s error=%r", target.node_id, error)
                with self._lock:
                    if target.node_id in self._watched:
                        self._drop(target.node_id)
                return
        with self._lock:
            if self._watched.get(target.node_id, (None, None))[1] != target:
                return
            self._drop(target.node_id)
        if not self._stopped.is_set():
            log.warning("probe closed, peer process gone node=%s", target.node_id)
            self._on_dead(target)
