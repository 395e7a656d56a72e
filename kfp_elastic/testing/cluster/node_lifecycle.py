"""The test cluster's node lifecycle: what kube-controller-manager's node lifecycle controller
and its taint manager do when a node stops heartbeating.

A kubelet that runs heartbeats on every pass of its loop (in Kubernetes it renews its Lease in
``kube-node-lease`` every 10 s; here the heartbeat is the :class:`Kubelet`'s ``heartbeat_at``,
not an API object). A node whose last heartbeat is older than ``monitor_grace_s`` gets
``Ready=Unknown`` (reason ``NodeStatusUnknown``) and the taints
``node.kubernetes.io/unreachable`` with effects NoSchedule and NoExecute. The taint manager then
evicts each pod bound there once its toleration of those taints runs out (at once when it has
none; the API server's DefaultTolerationSeconds admission gives every pod 300 s unless it says
otherwise): the pod gets ``DisruptionTarget`` (``DeletionByTaintManager``) and is deleted.

:func:`unreachable` and :func:`eviction_delay` are the pure decisions; :class:`NodeLifecycle`
applies them to the API server every ``monitor_period_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kfp_elastic.testing.api_events import NODE_CONTROLLER, TAINT_EVICTION
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError, now_timestamp
from kfp_elastic.testing.cluster.scheduler import tolerates

log = logging.getLogger(__name__)

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


@dataclass(frozen=True)
class NodeLifecycleSettings:
    """How fast the cluster notices a lost node and evicts its pods. The defaults are
    Kubernetes'; tests pass shorter ones (:data:`FAST_NODE_LIFECYCLE`)."""

    # kube-controller-manager --node-monitor-grace-period: no heartbeat for this long and the
    # node is Ready=Unknown and tainted unreachable (40 s; 50 s from Kubernetes 1.32).
    monitor_grace_s: float = 40.0
    # --node-monitor-period: how often the controller looks at nodes and their pods.
    monitor_period_s: float = 5.0
    # kube-apiserver --default-not-ready-toleration-seconds and
    # --default-unreachable-toleration-seconds (the DefaultTolerationSeconds admission plugin).
    default_toleration_s: int = 300

    def __post_init__(self) -> None:
        if self.monitor_grace_s <= 0 or self.monitor_period_s <= 0:
            raise ValueError(f"node lifecycle periods must be > 0: {self}")
        if self.default_toleration_s < 0:
            raise ValueError(f"default_toleration_s must be >= 0: {self}")


# What the test suite uses: a lost node's pods go within a few seconds.
FAST_NODE_LIFECYCLE = NodeLifecycleSettings(
    monitor_grace_s=1.0, monitor_period_s=0.1, default_toleration_s=2
)


def unreachable(now: float, last_heartbeat: float, grace_s: float) -> bool:
    """Whether a node whose kubelet last heartbeated at ``last_heartbeat`` is unreachable."""
    return now - last_heartbeat > grace_s


def unreachable_taints(added_at: str) -> list[dict[str, Any]]:
    """What the node lifecycle controller puts on an unreachable node."""
    return [
        {"key": UNREACHABLE_TAINT, "effect": effect, "timeAdded": added_at}
        for effect in ("NoSchedule", "NoExecute")
    ]


def eviction_delay(pod: dict[str, Any], taints: list[dict[str, Any]]) -> float | None:
    """Seconds after its NoExecute ``taints`` were added that the taint manager evicts ``pod``:
    0 when one of them is not tolerated, the smallest ``tolerationSeconds`` of the tolerations
    that tolerate them (negative counts as 0), None (never) when none of those has one."""
    no_execute = [t for t in taints if t.get("effect") == "NoExecute"]
    if not no_execute:
        return None
    tolerations = pod["spec"].get("tolerations") or []
    used = []
    for taint in no_execute:
        matching = [t for t in tolerations if tolerates(t, taint)]
        if not matching:
            return 0.0
        used += matching
    seconds = [t["tolerationSeconds"] for t in used if t.get("tolerationSeconds") is not None]
    return max(0.0, float(min(seconds))) if seconds else None


class NodeLifecycle:
    """Watches every node's heartbeat (``heartbeat(name)`` -> monotonic time, None for a node
    without a kubelet) and plays the node lifecycle controller and the taint manager, until
    :meth:`stop`."""

    def __init__(
        self,
        api: FakeKubernetes,
        heartbeat: Callable[[str], float | None],
        settings: NodeLifecycleSettings,
    ) -> None:
        self.api, self.heartbeat, self.settings = api, heartbeat, settings
        self._tainted_at: dict[str, float] = {}  # node -> monotonic time its taints were added
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="test-cluster-node-lifecycle")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.monitor_period_s):
            try:
                self.monitor_once()
            except Exception:  # one bad pass must not stop node monitoring
                log.exception("event=node_monitor_failed")

    def monitor_once(self, now: float | None = None) -> None:
        """One look at every node; ``now`` (monotonic) for tests that drive time."""
        now = time.monotonic() if now is None else now
        nodes = self.api.list_objects("nodes", "")["items"]
        names = {node["metadata"]["name"] for node in nodes}
        for name in [n for n in self._tainted_at if n not in names]:
            del self._tainted_at[name]
        for node in nodes:
            name = node["metadata"]["name"]
            last = self.heartbeat(name)
            if name not in self._tainted_at:
                if last is not None and not unreachable(now, last, self.settings.monitor_grace_s):
                    continue
                self._mark_unreachable(node)
                self._tainted_at[name] = now
            self._evict_due(name, node, now)

    def _mark_unreachable(self, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        status = node.setdefault("status", {})
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") != "Ready"
        ] + [
            {
                "type": "Ready",
                "status": "Unknown",
                "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.",
                "lastTransitionTime": now_timestamp(),
            }
        ]
        spec = node.setdefault("spec", {})
        kept = [t for t in spec.get("taints") or [] if t.get("key") != UNREACHABLE_TAINT]
        spec["taints"] = kept + unreachable_taints(now_timestamp())
        try:
            stored = self.api.replace_object("nodes", "", node)
        except ApiError:
            return  # the node went meanwhile
        # node-lifecycle-controller's events: on the node, and on each pod it marks not ready
        self.api.record_event(
            stored,
            "NodeNotReady",
            f"Node {name} status is now: NodeNotReady",
            component=NODE_CONTROLLER,
        )
        for pod in self.api.pods_snapshot():
            if pod["spec"].get("nodeName") == name:
                self.api.record_event(
                    pod,
                    "NodeNotReady",
                    "Node is not ready",
                    component=NODE_CONTROLLER,
                    event_type="Warning",
                )
        log.info("event=node_unreachable node=%s grace_s=%s", name, self.settings.monitor_grace_s)

    def _evict_due(self, name: str, node: dict[str, Any], now: float) -> None:
        taints = (node.get("spec") or {}).get("taints") or []
        elapsed = now - self._tainted_at[name]
        for pod in self.api.pods_snapshot():
            meta = pod["metadata"]
            # A pod already terminating there is taken too: no kubelet will confirm its end
            # (Kubernetes leaves it Terminating until pod GC, once the Node object is gone).
            if pod["spec"].get("nodeName") != name or pod["status"].get("phase") in (
                "Succeeded",
                "Failed",
            ):
                continue
            delay = eviction_delay(pod, taints)
            if delay is None or elapsed < delay:
                continue
            try:
                self.api.lose_node(meta["name"], ns=meta["namespace"])
            except ApiError:
                continue  # deleted meanwhile
            self.api.record_event(
                pod,
                "TaintManagerEviction",
                f"Marking for deletion Pod {meta['namespace']}/{meta['name']}",
                component=TAINT_EVICTION,
            )
            log.info(
                "event=pod_evicted_by_taint_manager pod=%s/%s node=%s after_s=%.1f",
                meta["namespace"],
                meta["name"],
                name,
                elapsed,
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
