"""The master's own pod: its deletion asks the master to step down, as SIGTERM does.

A container runtime sends SIGTERM to the container's main process only. Whether the master gets
it depends on what runs above it: on the KFP backend, Argo's emissary (PID 1) passes it to the
KFP launcher's process group, which holds the master; a shell or another program as PID 1 may
pass nothing on. The pod object says it in every case: a graceful delete sets
``metadata.deletionTimestamp`` before the kubelet acts. So a master that runs in a pod and knows
its name (``KFP_POD_NAME``, which the KFP backend sets on every task pod from the downward API's
``metadata.name``; set it yourself for ``kfp-elastic master`` in a pod of your own) watches its
pod and calls the SIGTERM handler's step-down when the deletion starts, whichever comes first.
It needs the list and watch verbs on pods that the master's Role has already (a watch of one
name, by field selector).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kfp_elastic.master.wiring import load_kubernetes_config, pod_namespace

log = logging.getLogger(__name__)

POD_NAME_ENV = "KFP_POD_NAME"
POD_UID_ENV = "KFP_POD_UID"  # the KFP backend sets it beside the name (``metadata.uid``)
REASON = "its pod is being deleted"
WATCH_TIMEOUT_S = 300  # the API server's watches end after a while; a new one starts then
RETRY_S = 1.0  # after a failed watch request (API server unreachable): not a busy loop


def own_pod_name(env: Mapping[str, str]) -> str | None:
    """This process's pod, when it runs in one (the kubelet sets ``KUBERNETES_SERVICE_HOST``)
    and knows its name; else None (no watch)."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    return env.get(POD_NAME_ENV) or None


def own_pod_uid(env: Mapping[str, str]) -> str | None:
    """This process's pod's uid, when its pod says it (``KFP_POD_UID``); else None."""
    return env.get(POD_UID_ENV) or None


def deletion_started(event_type: str, pod_name: str, pod: Any) -> bool:
    """Whether a watch event says the pod ``pod_name`` is being deleted (or is gone). ``pod``:
    the event's V1Pod; events of other pods (a server that ignores the field selector) say no."""
    meta = pod.metadata
    if meta is None or meta.name != pod_name:
        return False
    return event_type == "DELETED" or meta.deletion_timestamp is not None


class OwnPodWatch:
    """Watches pod ``name`` in ``namespace`` on a daemon thread; calls ``on_deleting`` once
    when its deletion starts. ``make_api``: a new ``kubernetes.client.ApiClient``."""

    def __init__(
        self,
        name: str,
        namespace: str,
        on_deleting: Callable[[], None],
        make_api: Callable[[], Any],
        *,
        retry_s: float = RETRY_S,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.name, self.namespace = name, namespace
        self.on_deleting, self.make_api = on_deleting, make_api
        self.retry_s, self.watch_timeout_s = retry_s, watch_timeout_s
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="own-pod-watch", daemon=True)

    def start(self) -> OwnPodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the thread ends at the stream's next event or timeout)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        from kubernetes import client, watch

        api = self.make_api()
        try:
            core = client.CoreV1Api(api)
            while not self._stop.is_set():
                self._watch = watch.Watch()
                try:
                    # No resourceVersion: the stream starts with the pod as it is now.
                    for event in self._watch.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        field_selector=f"metadata.name={self.name}",
                        timeout_seconds=self.watch_timeout_s,
                    ):
                        if self._stop.is_set():
                            return
                        kind = event.get("type", "")
                        if kind == "ERROR":  # expired: watch again from the pod as it is
                            break
                        if deletion_started(kind, self.name, event["object"]):
                            self._fire()
                            return
                except Exception as error:  # noqa: BLE001 - SIGTERM still works meanwhile
                    log.warning(
                        "own pod watch failed, retrying pod=%s/%s error=%r",
                        self.namespace,
                        self.name,
                        error,
                    )
                    self._stop.wait(self.retry_s)
        finally:
            api.close()

    def _fire(self) -> None:
        log.warning("own pod is being deleted pod=%s/%s: stepping down", self.namespace, self.name)
        self.fired.set()
        self.on_deleting()


def watch_own_pod(
    on_deleting: Callable[[], None], env: Mapping[str, str] | None = None
) -> OwnPodWatch | None:
    """Start watching this process's pod (in-cluster credentials), or None outside a pod or
    without ``KFP_POD_NAME``."""
    name = own_pod_name(os.environ if env is None else env)
    if name is None:
        return None
    from kubernetes import client

    try:
        load_kubernetes_config()
        namespace = pod_namespace()
    except Exception as error:  # noqa: BLE001 - SIGTERM still steps down; never fail the job
        log.warning("own pod not watched pod=%s error=%r", name, error)
        return None
    log.info("watching own pod for its deletion pod=%s/%s", namespace, name)
    return OwnPodWatch(name, namespace, on_deleting, client.ApiClient).start()
