"""What every controller of the test cluster shares: a thread that runs its reconcile step on
each change of the API server's state, as a Kubernetes controller reconciles on its watch events
(the scheduler, the ReplicaSet controller, the Kueue stand-in)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kfp_elastic.testing.api_server import FakeKubernetes

log = logging.getLogger(__name__)

# How long a controller waits for a change before it checks whether it was stopped (and, for
# one that also acts on time, like the kubelet, reconciles anyway).
STOP_CHECK_S = 0.5


class ControlLoop:
    """Runs ``reconcile()`` on every change in ``api`` from now until :meth:`stop` (what it
    made stays). Made last in a controller's set-up: it starts at once."""

    def __init__(
        self,
        api: FakeKubernetes,
        name: str,
        reconcile: Callable[[], object],
        wait_s: float = STOP_CHECK_S,
    ) -> None:
        self.api = api
        self.name = name
        self._reconcile = reconcile
        self._wait_s = wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def _loop(self) -> None:
        seen = 0
        while not self._stop.is_set():
            seen = self.api.wait_for_change(seen, timeout=self._wait_s)
            if self._stop.is_set():
                return
            try:
                self._reconcile()
            except Exception:  # a bug here must not silently stop the controller
                log.exception("event=reconcile_failed controller=%s", self.name)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop; wait up to ``timeout`` s (None: until done) for a reconcile under way."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
