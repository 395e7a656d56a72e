"""``TestCluster``: API server + scheduler + kubelets, started and torn down together."""

from __future__ import annotations

import logging
import platform
import uuid
from pathlib import Path
from typing import Any

import yaml

from kfp_elastic.components.common import run_pids
from kfp_elastic.etcd.pki import generate_test_pki
from kfp_elastic.testing.api_discovery import VERSION
from kfp_elastic.testing.api_events import KUBELET
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError, now_timestamp
from kfp_elastic.testing.cluster.kubelet import CLUSTER_ENV, ClusterAccess, Kubelet
from kfp_elastic.testing.cluster.kueue import Kueue, KueueQueue, install_kueue_crds
from kfp_elastic.testing.cluster.node_lifecycle import NodeLifecycle, NodeLifecycleSettings
from kfp_elastic.testing.cluster.scheduler import Scheduler

log = logging.getLogger(__name__)

# What a node's kubelet reports of itself (``kubectl get nodes -o wide``, ``describe node``):
# the API server's version, the machine the pods' processes run on.
NODE_INFO = {
    "kubeletVersion": VERSION["gitVersion"].partition("-")[0],
    "kubeProxyVersion": "",
    "osImage": f"{platform.system()} (test cluster: pods are host processes)",
    "kernelVersion": platform.release(),
    "containerRuntimeVersion": "testcluster://1",
    "operatingSystem": platform.system().lower(),
    "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(
        platform.machine(), platform.machine()
    ),
    "machineID": "",
    "systemUUID": "",
    "bootID": "",
}

# The master's ServiceAccount, Role and RoleBinding as the manifests install them.
MASTER_RBAC: list[dict[str, Any]] = [
    obj
    for obj in yaml.safe_load_all(
        (Path(__file__).resolve().parents[3] / "manifests" / "base" / "rbac.yaml").read_text()
    )
    if obj
]


class TestCluster:
    """``with TestCluster(tmp_path, nodes={"node-1": {"cpu": "2"}}) as cluster:``

    ``cluster.api`` is the API server (its test hooks too), ``cluster.client()`` a real
    ``kubernetes`` ApiClient for it. Nodes come and go at run time (:meth:`add_node`,
    :meth:`remove_node`, :meth:`hang_node`, :meth:`set_capacity`); a lost node's API objects
    change on Kubernetes' timeline, as fast as ``node_lifecycle`` says (Kubernetes' defaults
    unless given; tests pass ``FAST_NODE_LIFECYCLE``). On exit every pod process is killed,
    every thread joined and the server closed; :meth:`leftover_processes` says whether any
    escaped.

    ``kubectl`` works against it: the cluster writes its admin's kubeconfig to
    ``<root>/kubeconfig`` (:attr:`kubeconfig`); the scheduler, kubelets and node controllers
    record Events (``kubectl get events``, ``kubectl describe``). What kubectl can and cannot
    do here: ``docs/testing.md``, "kubectl against the test cluster".
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        root: str | Path,
        nodes: dict[str, dict[str, str | int]] | None = None,
        namespace: str = "default",
        rbac: list[dict[str, Any]] | None = None,
        node_lifecycle: NodeLifecycleSettings | None = None,
        kueue: KueueQueue | None = None,
        kueue_crds: bool = False,
        **api_options: Any,
    ) -> None:
        """``rbac``: the Roles, ClusterRoles and bindings installed at start (None: the master's
        from ``manifests/base/rbac.yaml``, as ``kubectl apply -k`` installs them); the API
        server authorizes every pod's requests by them. ``kueue``: a Kueue stand-in
        (``kueue.py``) gates the pods that name a queue and admits those of this LocalQueue
        into its quota (None: no Kueue). ``kueue_crds``: Kueue's CustomResourceDefinitions are
        installed (``kueue.install_kueue_crds``), so that its kinds are served and ``kubectl
        apply -k manifests/kueue`` creates its objects (:meth:`start_kueue` reads them)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        pki = generate_test_pki(self.root / "pki")
        self.ca_file = pki.ca
        self.id = uuid.uuid4().hex
        self.node_lifecycle = node_lifecycle or NodeLifecycleSettings()
        api_options.setdefault(
            "default_toleration_seconds", self.node_lifecycle.default_toleration_s
        )
        admin_token = f"test-cluster-{uuid.uuid4().hex}"
        self.api = FakeKubernetes(
            namespace=namespace,
            kubelet=False,
            tls=(str(pki.server.cert), str(pki.server.key)),
            admin_tokens=(admin_token,),
            **api_options,
        )
        self.access = ClusterAccess(
            host="127.0.0.1",
            port=self.api.port,
            ca_file=self.ca_file,
            token=admin_token,
            cluster_id=self.id,
        )
        self.api.pod_logs = self._container_log
        self.kubeconfig = self.root / "kubeconfig"
        self.write_kubeconfig(self.kubeconfig)
        for obj in MASTER_RBAC if rbac is None else rbac:
            self.apply(obj)
        if kueue_crds:
            install_kueue_crds(self.api)
        self.kubelets: dict[str, Kubelet] = {}  # the nodes that run
        self.lost: dict[str, Kubelet] = {}  # powered off or hung: silent, logs kept
        self.scheduler = Scheduler(self.api)
        self.kueue = None if kueue is None else Kueue(self.api, kueue, namespace)
        self.lifecycle = NodeLifecycle(self.api, self._heartbeat, self.node_lifecycle)
        for name, capacity in (nodes or {"node-1": {"cpu": "4", "memory": "8Gi"}}).items():
            self.add_node(name, **capacity)

    def start_kueue(self, queue: KueueQueue | None = None) -> Kueue:
        """Start the Kueue stand-in now (none may run yet) for ``queue``, by default the one the
        stored Kueue objects describe (``KueueQueue.from_api``: after ``kubectl apply -k
        manifests/kueue`` on a cluster made with ``kueue_crds=True``). Pods created before are
        not gated."""
        if self.kueue is not None:
            raise RuntimeError("the Kueue stand-in runs already")
        if queue is None:
            queue = KueueQueue.from_api(self.api, self.namespace)
        self.kueue = Kueue(self.api, queue, self.namespace)
        return self.kueue

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def namespace(self) -> str:
        return self.api.namespace

    def client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` that trusts the cluster's CA; close it after use."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.api.url
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {self.access.token}"}
        return client.ApiClient(configuration)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for ``kubectl`` (or any client) as the cluster's admin: its URL, its CA,
        the admin token, the namespace; the cluster writes one to ``<root>/kubeconfig``
        (``KUBECONFIG=<root>/kubeconfig kubectl get pods``)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test-cluster",
                    "cluster": {"server": self.api.url, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": "admin", "user": {"token": self.access.token}}],
            "contexts": [
                {
                    "name": "test-cluster",
                    "context": {
                        "cluster": "test-cluster",
                        "user": "admin",
                        "namespace": self.namespace,
                    },
                }
            ],
            "current-context": "test-cluster",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def apply(self, obj: dict[str, Any], ns: str | None = None) -> None:
        """Create or replace one object of the kinds the API server stores besides pods
        (Role, RoleBinding, ServiceAccount, PodDisruptionBudget, ..., and the custom kinds of
        its CRDs), in ``ns`` unless cluster-scoped."""
        ns = obj.get("metadata", {}).get("namespace") or ns or self.namespace
        kinds, cluster_scoped = self.api.object_kinds()  # custom kinds of its CRDs too
        resource = next(r for r, (kind, _) in kinds.items() if kind == obj["kind"])
        ns = "" if resource in cluster_scoped else ns
        try:
            self.api.create_object(resource, ns, obj)
        except ApiError as error:
            if error.status["code"] != 409:
                raise
            self.api.replace_object(resource, ns, obj)

    # -- nodes -------------------------------------------------------------------------

    def _heartbeat(self, name: str) -> float | None:
        kubelet = self.kubelets.get(name) or self.lost.get(name)
        return None if kubelet is None else kubelet.last_heartbeat()

    @staticmethod
    def _node(name: str, capacity: dict[str, str | int]) -> dict[str, Any]:
        resources = {
            key.replace("gpu", "nvidia.com/gpu") if key == "gpu" else key: str(value)
            for key, value in capacity.items()
        }
        resources.setdefault("pods", "110")
        now = now_timestamp()
        return {
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": name},
                ],
                "nodeInfo": NODE_INFO,
            },
        }

    def add_node(self, name: str, start_delay_s: float = 0.0, **capacity: str | int) -> None:
        """A node with ``capacity`` (``cpu``, ``memory``, ``gpu`` for ``nvidia.com/gpu``) and a
        kubelet that starts running what the scheduler binds to it, each pod ``start_delay_s``
        after it came (the image pull: seconds to minutes on a real cluster)."""
        if name in self.kubelets or name in self.lost:
            raise ValueError(f"node {name!r} exists already (a lost node's Node object stays)")
        self.kubelets[name] = Kubelet(
            self.api, name, self.root, self.access, start_delay_s=start_delay_s
        )
        node = self.api.create_object("nodes", "", self._node(name, capacity))
        for reason, message in (
            ("Starting", "Starting kubelet."),
            ("NodeReady", f"Node {name} status is now: NodeReady"),
        ):
            self.api.record_event(node, reason, message, component=KUBELET, host=name)
        log.info(
            "event=node_added node=%s capacity=%s start_delay_s=%s", name, capacity, start_delay_s
        )

    def set_capacity(self, name: str, **capacity: str | int) -> None:
        """Change what a node can hold (pods already on it stay; its taints and conditions
        too)."""
        node = self._node(name, capacity)
        old = self.api.get_object("nodes", "", name)
        node["spec"] = old.get("spec") or {}
        node["status"]["conditions"] = old["status"]["conditions"]
        self.api.replace_object("nodes", "", node)
        log.info("event=node_resized node=%s capacity=%s", name, capacity)

    def remove_node(self, name: str) -> None:
        """The node is lost (powered off): its processes die at once (SIGKILL) and it stops
        heartbeating. Its API objects change as in Kubernetes: after the node monitor grace
        the Node is ``Ready=Unknown`` and tainted unreachable (NoSchedule, NoExecute), and
        each of its pods is evicted once its toleration of that runs out (``DisruptionTarget``
        ``DeletionByTaintManager``, then deleted). The Node object stays, NotReady."""
        kubelet = self.kubelets.pop(name)
        self.lost[name] = kubelet
        kubelet.power_off()
        log.info("event=node_removed node=%s", name)

    def hang_node(self, name: str) -> None:
        """The node hangs or is cut off: its pods' processes are stopped (SIGSTOP; their
        sockets stay open, nothing answers) and it stops heartbeating; the API side goes as
        in :meth:`remove_node`. The processes are killed when the cluster stops."""
        kubelet = self.kubelets.pop(name)
        self.lost[name] = kubelet
        kubelet.hang()
        log.info("event=node_hung node=%s", name)

    # -- inspection --------------------------------------------------------------------

    def log(self, name: str, container: str | None = None, ns: str | None = None) -> str:
        """What a pod's container wrote (stdout and stderr), from the node that ran it."""
        ns = ns or self.namespace
        for kubelet in [*self.kubelets.values(), *self.lost.values()]:
            path = kubelet.log_path(ns, name, container or "*")
            if path is not None:
                return path.read_text()
        return ""

    def _container_log(self, ns: str, name: str, container: str) -> str | None:
        """``pods/log`` for the API server: None where no node has started the container."""
        for kubelet in [*self.kubelets.values(), *self.lost.values()]:
            path = kubelet.log_path(ns, name, container)
            if path is not None:
                return path.read_text(errors="replace")
        return None

    def claim_path(self, claim: str, ns: str | None = None) -> Path:
        """The host directory that stands for PersistentVolumeClaim ``claim`` (kubelet.py)."""
        return self.root / "claims" / (ns or self.namespace) / claim

    def leftover_processes(self) -> set[int]:
        """Live processes started by this cluster's pods."""
        return run_pids(self.id, CLUSTER_ENV)

    def stop(self) -> None:
        self.lifecycle.stop()
        if self.kueue is not None:
            self.kueue.stop()
        self.scheduler.stop()
        for kubelets in (self.kubelets, self.lost):
            for name in list(kubelets):
                kubelets.pop(name).stop()
        self.api.stop()
