"""The test cluster's kubelet: runs every pod bound to its node as local process trees.

Real: each container's ``command`` + ``args`` runs as a process (in a session of its own) with
the pod's env, including ``valueFrom`` ConfigMap/Secret keys and the downward API; volumes are
host directories (emptyDir: one per pod, persistentVolumeClaim: one per claim, shared; Secret and
ConfigMap: files written from the objects, honoring ``items``); the service-account volume (token,
ca.crt, namespace) and ``KUBERNETES_SERVICE_HOST/PORT`` lead to the API server; status is real
(Running with containerStatuses, then Succeeded/Failed with the exit code and reason ``Completed``
or ``Error``); deletion is graceful as a container runtime makes it: SIGTERM to each container's
main process only (the process the kubelet started: PID 1 of the container), then SIGKILL of
everything the pod started once ``terminationGracePeriodSeconds`` passed; once the main processes
have ended, every process they left behind is SIGKILLed at once, as a container's PID namespace
ends with its init (per pod here, not per container); output goes to one log file per container.
It records the kubelet's events on the pods (``Pulling``/``Pulled``, ``Created``, ``Started``,
``Killing``, ``Failed`` for a container it cannot configure) and on its node
(``NodeNotSchedulable`` once it is cordoned, ``NodeSchedulable`` once uncordoned).

Mounts: a process cannot see a host directory at a container path such as /etc/etcd-tls, so the
kubelet rewrites every mountPath it finds (at a path boundary) in ``command``, ``args``,
``workingDir`` and env values to the host directory, and exports the mapping as JSON in
``KFP_ELASTIC_TEST_CLUSTER_MOUNTS``. Fixed paths read by code that takes no setting (the
kubernetes client's in-cluster token and CA) are repointed by ``pod_python/sitecustomize.py``.

Before a pod's processes start, the node may take ``start_delay_s`` (an image pull: seconds to
minutes on a real cluster, 0 by default here) during which the pod is Pending on the node with
its containers ``waiting`` (reason ``ContainerCreating``).

Node loss: :meth:`Kubelet.power_off` kills every process of the node's pods at once (the machine
is off), :meth:`Kubelet.hang` stops them (SIGSTOP: sockets stay open, nothing answers); either way
the kubelet stops syncing and heartbeating, and the API objects change only on the Kubernetes
timeline of ``node_lifecycle.py``. A kubelet that runs counts as heartbeating (its Lease is not
an API object here).

Not simulated: container restarts (every restartPolicy behaves as Never), init containers,
probes, images (the host's Python runs the command; a pull is only the delay above), resource
limits, network isolation (every pod's IP is 127.0.0.1).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kfp_elastic.components.common import run_pids
from kfp_elastic.processes import sigkill_tagged
from kfp_elastic.testing.api_events import KUBELET, container_path
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError, now_timestamp
from kfp_elastic.testing.cluster.controller import ControlLoop

log = logging.getLogger(__name__)

POD_UID_ENV = "KFP_ELASTIC_TEST_POD_UID"  # every process of a pod has it: the pod's "cgroup"
CLUSTER_ENV = "KFP_ELASTIC_TEST_CLUSTER"  # every process of the cluster has it
MOUNTS_ENV = "KFP_ELASTIC_TEST_CLUSTER_MOUNTS"  # mountPath -> host directory, as JSON
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
POD_PYTHON = Path(__file__).resolve().parent / "pod_python"  # holds sitecustomize.py
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_LABEL = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


class PodConfigError(Exception):
    """The pod cannot start yet (a missing ConfigMap or Secret key, an unsupported volume):
    Kubernetes' CreateContainerConfigError."""


@dataclass(frozen=True)
class ClusterAccess:
    """How pods reach the API server: its address and the CA that signed its certificate;
    ``token`` is the harness's admin token (each pod gets its service account's own)."""

    host: str
    port: int
    ca_file: Path
    token: str
    cluster_id: str


# -- pure parts: env, mounts, volumes ----------------------------------------------------------


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes."""
    return _VAR_REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def rewrite_mount_paths(text: str, mounts: dict[str, str]) -> str:
    """Every mountPath in ``text`` (at a path boundary, so ``--ca=/etc/tls/ca.crt`` counts)
    replaced by its host directory; longer mount paths win."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        pattern = r"(?<![\w./-])" + re.escape(mount_path.rstrip("/")) + r"(?=/|$|[^\w.-])"
        text = re.sub(pattern, lambda _m, p=mount_path: mounts[p], text)
    return text


def field_value(pod: dict[str, Any], path: str) -> str:
    """The downward API's fieldRef values; the pod's IP is the host's loopback."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }
    if path in simple:
        return simple[path]
    m = _FIELD_LABEL.fullmatch(path)
    if m:
        return (meta.get(m[1]) or {}).get(m[2], "")
    raise PodConfigError(f"unsupported fieldRef fieldPath {path!r}")


def object_data(obj: dict[str, Any]) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys as bytes (Secret ``data`` is base64, as stored)."""
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


Lookup = Callable[[str, str], dict[str, Any] | None]  # (resource, name) -> object or None


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    lookup: Lookup,
    base: dict[str, str],
) -> dict[str, str]:
    """The container's environment: ``base`` (the kubelet's), then ``envFrom``, then ``env``
    in order with ``$(VAR)`` expansion and ``valueFrom`` resolved."""
    env = dict(base)

    def source(resource: str, ref: dict[str, Any]) -> dict[str, bytes] | None:
        obj = lookup(resource, ref["name"])
        if obj is None and not ref.get("optional"):
            raise PodConfigError(f'{resource[:-1]} "{ref["name"]}" not found')
        return None if obj is None else object_data(obj)

    for item in container.get("envFrom") or []:
        for resource, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            if key in item:
                for name, value in (source(resource, item[key]) or {}).items():
                    env[item.get("prefix", "") + name] = value.decode()
    for var in container.get("env") or []:
        if "valueFrom" not in var:
            env[var["name"]] = expand_vars(var.get("value", ""), env)
            continue
        value_from = var["valueFrom"]
        if "fieldRef" in value_from:
            env[var["name"]] = field_value(pod, value_from["fieldRef"]["fieldPath"])
            continue
        for resource, key in (("configmaps", "configMapKeyRef"), ("secrets", "secretKeyRef")):
            if key in value_from:
                ref = value_from[key]
                data = source(resource, ref)
                if data is not None and ref["key"] in data:
                    env[var["name"]] = data[ref["key"]].decode()
                elif data is not None and not ref.get("optional"):
                    raise PodConfigError(f'key "{ref["key"]}" not found in {ref["name"]}')
                break
        else:
            raise PodConfigError(f"unsupported valueFrom in env {var['name']!r}")
    return env


def write_projection(directory: Path, data: dict[str, bytes], items: list[dict] | None) -> None:
    """Files of a Secret/ConfigMap volume: every key, or only ``items`` at their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    chosen = items or [{"key": key, "path": key} for key in data]
    for item in chosen:
        if item["key"] not in data:
            raise PodConfigError(f'key "{item["key"]}" not found for volume {directory.name}')
        target = directory / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[item["key"]])
        if "mode" in item:
            target.chmod(item["mode"])


def prepare_volumes(
    pod: dict[str, Any], pod_dir: Path, claims_dir: Path, lookup: Lookup
) -> dict[str, Path]:
    """Volume name -> host directory, created and filled."""
    volumes = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if "emptyDir" in volume:
            path = pod_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
        elif "persistentVolumeClaim" in volume:
            path = claims_dir / volume["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
        elif "secret" in volume or "configMap" in volume:
            resource, ref = (
                ("secrets", volume["secret"])
                if "secret" in volume
                else ("configmaps", volume["configMap"])
            )
            obj_name = ref.get("secretName") or ref.get("name")
            obj = lookup(resource, obj_name)
            if obj is None and not ref.get("optional"):
                raise PodConfigError(f'{resource[:-1]} "{obj_name}" not found')
            path = pod_dir / "volumes" / name
            data = {} if obj is None else object_data(obj)
            write_projection(path, data, ref.get("items"))
        else:
            kinds = sorted(set(volume) - {"name"})
            raise PodConfigError(f"volume {name!r}: {kinds} not supported by the test cluster")
        volumes[name] = path
    return volumes


def container_mounts(container: dict[str, Any], volumes: dict[str, Path]) -> dict[str, str]:
    """mountPath -> host directory of one container."""
    mounts = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise PodConfigError(f"volumeMount {mount['name']!r} names no volume")
        host = volumes[mount["name"]] / mount.get("subPath", "")
        mounts[mount["mountPath"].rstrip("/") or "/"] = str(host)
    return mounts


def waiting_status(container: dict[str, Any], waiting: dict[str, str]) -> dict[str, Any]:
    """A container's status while it waits to run (``waiting``: its reason and message)."""
    return {
        "name": container["name"],
        "state": {"waiting": waiting},
        "ready": False,
        "started": False,
        "restartCount": 0,
        "image": container["image"],
        "imageID": "",
    }


def exit_code(returncode: int) -> int:
    """Popen's returncode as a container runtime reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


# -- the running side ------------------------------------------------------------------------


@dataclass
class _Container:
    name: str
    process: subprocess.Popen
    log: TextIO
    started_at: str
    finished_at: str | None = None


@dataclass
class _RunningPod:
    key: tuple[str, str]
    uid: str
    containers: list[_Container]
    terminating: bool = False
    reported: bool = False  # terminal status written
    sigterm_at: float | None = None
    grace_s: float = 30.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def exited(self) -> bool:
        return all(c.process.poll() is not None for c in self.containers)


class Kubelet:
    """The node agent of ``node``: reconciles the pods bound to it on every API change and
    every ``poll_s`` (processes end without telling the API server)."""

    def __init__(
        self,
        api: FakeKubernetes,
        node: str,
        root: Path,
        access: ClusterAccess,
        poll_s: float = 0.1,
        start_delay_s: float = 0.0,
    ) -> None:
        if start_delay_s < 0:
            raise ValueError(f"start_delay_s must be >= 0, got {start_delay_s}")
        self.api, self.node, self.access, self.poll_s = api, node, access, poll_s
        self.start_delay_s = start_delay_s
        self.root = root / "nodes" / node
        self.claims_dir = root / "claims"
        self._pods: dict[str, _RunningPod] = {}  # by uid
        self._creating: dict[str, float] = {}  # uid -> when its containers may start
        self._silent_since: float | None = None  # powered off or hung at this monotonic time
        self._unschedulable = False  # the node's spec.unschedulable as last seen
        self._loop = ControlLoop(api, f"kubelet-{node}", self.sync, wait_s=self.poll_s)

    def last_heartbeat(self) -> float:
        """When the node last heartbeated (monotonic): now while it runs, else the moment it
        was powered off or hung."""
        return time.monotonic() if self._silent_since is None else self._silent_since

    def sync(self) -> None:
        self._record_schedulable()
        pods = [p for p in self.api.pods_snapshot() if p["spec"].get("nodeName") == self.node]
        present = {p["metadata"]["uid"] for p in pods}
        for uid in [u for u in self._pods if u not in present]:
            self._force_stop(self._pods[uid])  # force-deleted (grace 0) or garbage: kill now
        for uid in [u for u in self._creating if u not in present]:
            del self._creating[uid]
        for pod in pods:
            meta = pod["metadata"]
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            running = self._pods.get(uid)
            if running is None:
                if meta.get("deletionTimestamp"):
                    self._api(self.api.remove_pod, ns, name)
                elif pod["status"].get("phase") == "Pending" and not self._pulling(pod):
                    self._creating.pop(uid, None)
                    self._start(pod)
                continue
            if meta.get("deletionTimestamp") and not running.terminating:
                running.terminating = True
                running.grace_s = float(meta.get("deletionGracePeriodSeconds", 30))
                for c in running.containers:
                    self._event(pod, "Killing", f"Stopping container {c.name}", c.name)
                self._sigterm(running)
            if running.terminating and not running.exited():
                assert running.sigterm_at is not None
                if time.monotonic() - running.sigterm_at >= running.grace_s:
                    self._kill_all(running)
            if running.exited() and not running.reported:
                self._kill_all(running)  # a container's end ends everything it left behind
                self._report_terminal(pod, running)
            if running.reported and running.terminating:
                self._api(self.api.remove_pod, ns, name)
                self._forget(running)

    # -- start -------------------------------------------------------------------------

    def _pulling(self, pod: dict[str, Any]) -> bool:
        """Whether the node is still getting the pod's images (``start_delay_s``); the first
        time, the pod's containers are reported ``waiting``/``ContainerCreating``."""
        if self.start_delay_s <= 0:
            return False
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        if uid not in self._creating:
            self._creating[uid] = time.monotonic() + self.start_delay_s
            now = now_timestamp()
            self._api(
                self.api.update_status,
                meta["namespace"],
                meta["name"],
                {
                    "hostIP": "127.0.0.1",
                    "startTime": now,
                    "conditions": [
                        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                        *(
                            {
                                "type": kind,
                                "status": "False",
                                "reason": "ContainersNotReady",
                                "lastTransitionTime": now,
                            }
                            for kind in ("ContainersReady", "Ready")
                        ),
                    ],
                    "containerStatuses": [
                        waiting_status(c, {"reason": "ContainerCreating"})
                        for c in spec["containers"]
                    ],
                },
            )
            for c in spec["containers"]:
                self._event(pod, "Pulling", f'Pulling image "{c["image"]}"', c["name"])
            log.info(
                "event=pod_container_creating pod=%s/%s node=%s start_delay_s=%s",
                meta["namespace"],
                meta["name"],
                self.node,
                self.start_delay_s,
            )
        return time.monotonic() < self._creating[uid]

    def _lookup(self, ns: str) -> Lookup:
        def lookup(resource: str, name: str) -> dict[str, Any] | None:
            try:
                return self.api.get_object(resource, ns, name)
            except ApiError:
                return None

        return lookup

    def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        pod_dir = self.root / "pods" / f"{ns}_{name}_{uid}"
        # Also without volumes or a service-account token: the logs and the working dir live here.
        pod_dir.mkdir(parents=True, exist_ok=True)
        lookup = self._lookup(ns)
        try:
            volumes = prepare_volumes(pod, pod_dir, self.claims_dir / ns, lookup)
            launches = []
            for container in spec["containers"]:
                mounts = container_mounts(container, volumes)
                if spec.get("automountServiceAccountToken", True):
                    mounts[SERVICE_ACCOUNT_DIR] = str(self._service_account(pod_dir, pod))
                env = container_env(pod, container, lookup, self._base_env(pod, mounts))
                env = {  # the mount map itself keeps the in-pod paths it maps
                    k: v if k == MOUNTS_ENV else rewrite_mount_paths(v, mounts)
                    for k, v in env.items()
                }
                argv = [
                    rewrite_mount_paths(expand_vars(a, env), mounts)
                    for a in (container.get("command") or []) + (container.get("args") or [])
                ]
                if not argv:
                    raise PodConfigError(f"container {container['name']!r} has no command")
                cwd = rewrite_mount_paths(container.get("workingDir") or str(pod_dir), mounts)
                launches.append((container["name"], argv, env, cwd))
        except PodConfigError as exc:
            waiting = [
                (s.get("state") or {}).get("waiting", {}).get("message")
                for s in pod["status"].get("containerStatuses") or []
            ]
            if str(exc) in waiting:
                return  # already said; writing again would wake every watcher for nothing
            self._api(
                self.api.update_status,
                ns,
                name,
                {
                    "containerStatuses": [
                        waiting_status(
                            c, {"reason": "CreateContainerConfigError", "message": str(exc)}
                        )
                        for c in spec["containers"]
                    ]
                },
            )
            for c in spec["containers"]:
                self._event(pod, "Failed", f"Error: {exc}", c["name"], "Warning")
            log.info("event=pod_config_error pod=%s/%s error=%r", ns, name, str(exc))
            return
        containers = []
        for cname, argv, env, cwd in launches:
            log_file = open(pod_dir / f"{cname}.log", "a")  # closed with the pod
            try:
                process = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                log_file.write(f"test-cluster kubelet: cannot start {argv!r}: {exc}\n")
                log_file.flush()
                process = subprocess.Popen(  # what a container whose command fails reports
                    [sys.executable, "-c", "raise SystemExit(127)"],
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            containers.append(_Container(cname, process, log_file, now_timestamp()))
        running = _RunningPod((ns, name), uid, containers)
        self._pods[uid] = running
        for container in spec["containers"]:
            cname, image = container["name"], container["image"]
            pulled = (
                f'Successfully pulled image "{image}"'
                if self.start_delay_s > 0
                else f'Container image "{image}" already present on machine'
            )
            self._event(pod, "Pulled", pulled, cname)
            self._event(pod, "Created", f"Created container: {cname}", cname)
            self._event(pod, "Started", f"Started container {cname}", cname)
        now = now_timestamp()
        self._api(
            self.api.update_status,
            ns,
            name,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "startTime": now,
                "conditions": [
                    {"type": kind, "status": "True", "lastTransitionTime": now}
                    for kind in ("Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    self._container_status(pod, c, {"running": {"startedAt": c.started_at}})
                    for c in containers
                ],
            },
        )
        log.info(
            "event=pod_started pod=%s/%s node=%s pids=%s",
            ns,
            name,
            self.node,
            [c.process.pid for c in containers],
        )

    def _service_account(self, pod_dir: Path, pod: dict[str, Any]) -> Path:
        """The pod's own service account's token (RBAC authorizes what it asks for), the CA
        and the namespace."""
        ns = pod["metadata"]["namespace"]
        account = pod["spec"].get("serviceAccountName") or "default"
        directory = pod_dir / "serviceaccount"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(self.api.service_account_token(ns, account))
        (directory / "ca.crt").write_bytes(self.access.ca_file.read_bytes())
        (directory / "namespace").write_text(ns)
        return directory

    def _base_env(self, pod: dict[str, Any], mounts: dict[str, str]) -> dict[str, str]:
        """What every container gets before its own env: the host's PATH (this Python's bin
        first), the in-cluster service variables, the markers and the mount map."""
        host_path = os.environ.get("PATH", "/usr/bin:/bin")
        python_path = [str(POD_PYTHON)] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
        ]
        env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), host_path]),
            "HOME": os.environ.get("HOME", "/tmp"),
            "HOSTNAME": pod["metadata"]["name"],
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
            "KUBERNETES_SERVICE_HOST": self.access.host,
            "KUBERNETES_SERVICE_PORT": str(self.access.port),
            POD_UID_ENV: pod["metadata"]["uid"],
            CLUSTER_ENV: self.access.cluster_id,
            MOUNTS_ENV: json.dumps(mounts),
        }
        for name in ("LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    # -- stop --------------------------------------------------------------------------

    def _sigterm(self, running: _RunningPod) -> None:
        """What the container runtime does first: SIGTERM to each container's main process
        (PID 1 of the container), not to its children: passing it on is that process's job."""
        running.sigterm_at = time.monotonic()
        for c in running.containers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(c.process.pid, signal.SIGTERM)
        log.info("event=pod_sigterm pod=%s/%s grace_s=%s", *running.key, running.grace_s)

    def _kill_all(self, running: _RunningPod) -> None:
        """SIGKILL every process the pod started, wherever it went (its own sessions too):
        the end of a container's cgroup."""
        for c in running.containers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.process.pid, signal.SIGKILL)
        sigkill_tagged(POD_UID_ENV, running.uid, rounds=50, pause_s=0.02)
        for c in running.containers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.process.wait(timeout=5)

    def _report_terminal(self, pod: dict[str, Any], running: _RunningPod) -> None:
        codes = [exit_code(c.process.returncode) for c in running.containers]
        phase = "Succeeded" if not any(codes) else "Failed"
        now = now_timestamp()
        statuses = []
        for c, code in zip(running.containers, codes, strict=True):
            c.finished_at = c.finished_at or now
            c.log.close()
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": c.started_at,
                    "finishedAt": c.finished_at,
                    "containerID": f"testcluster://{c.process.pid}",
                }
            }
            statuses.append(self._container_status(pod, c, state))
        self._api(
            self.api.update_status,
            *running.key,
            {
                "phase": phase,
                "conditions": [
                    {"type": kind, "status": "False", "lastTransitionTime": now}
                    for kind in ("ContainersReady", "Ready")
                ],
                "containerStatuses": statuses,
            },
        )
        running.reported = True
        log.info("event=pod_finished pod=%s/%s phase=%s exit_codes=%s", *running.key, phase, codes)

    @staticmethod
    def _container_status(
        pod: dict[str, Any], c: _Container, state: dict[str, Any]
    ) -> dict[str, Any]:
        image = next(x["image"] for x in pod["spec"]["containers"] if x["name"] == c.name)
        return {
            "name": c.name,
            "state": state,
            "ready": "running" in state,
            "started": "running" in state,
            "restartCount": 0,
            "image": image,
            "imageID": image,
            "containerID": f"testcluster://{c.process.pid}",
        }

    def _force_stop(self, running: _RunningPod) -> None:
        self._kill_all(running)
        self._forget(running)
        log.info("event=pod_killed pod=%s/%s reason=gone_from_api", *running.key)

    def _forget(self, running: _RunningPod) -> None:
        for c in running.containers:
            c.log.close()
        self._pods.pop(running.uid, None)

    def _event(
        self,
        pod: dict[str, Any],
        reason: str,
        message: str,
        container: str,
        event_type: str = "Normal",
    ) -> None:
        """The kubelet's event about a container of ``pod`` (``kubectl describe pod``)."""
        self.api.record_event(
            pod,  # as stored: its kind and apiVersion make the reference
            reason,
            message,
            component=KUBELET,
            event_type=event_type,
            host=self.node,
            field_path=container_path(container),
        )

    def _record_schedulable(self) -> None:
        """``NodeNotSchedulable`` / ``NodeSchedulable`` on the node when its
        ``spec.unschedulable`` changed (``kubectl cordon``, ``drain``, ``uncordon``), as the
        kubelet's node status update records them."""
        try:
            node = self.api.get_object("nodes", "", self.node)
        except ApiError:  # not created yet, or deleted
            return
        unschedulable = bool((node.get("spec") or {}).get("unschedulable"))
        if unschedulable == self._unschedulable:
            return
        self._unschedulable = unschedulable
        reason = "NodeNotSchedulable" if unschedulable else "NodeSchedulable"
        message = f"Node {self.node} status is now: {reason}"
        self.api.record_event(node, reason, message, component=KUBELET, host=self.node)

    def _api(self, action: Callable[..., Any], *args: Any) -> None:
        try:
            action(*args)
        except ApiError as exc:  # the pod changed or went meanwhile: the next sync sees it
            reason = exc.status["reason"]
            log.info("event=kubelet_write_skipped node=%s reason=%s", self.node, reason)

    # -- node lifecycle ------------------------------------------------------------------

    def _silence(self) -> None:
        """No more syncs and no more heartbeats."""
        if self._silent_since is None:
            self._silent_since = time.monotonic()
        self._loop.stop(timeout=None)

    def power_off(self) -> None:
        """The machine goes off: every process of its pods is SIGKILLed at once; the API
        objects are left to the node lifecycle controller."""
        self._silence()
        for running in list(self._pods.values()):
            self._kill_all(running)
            self._forget(running)
        log.info("event=node_powered_off node=%s", self.node)

    def hang(self) -> None:
        """The host hangs (or is cut off): every process of its pods is stopped (SIGSTOP; their
        sockets stay open but nothing answers) and the kubelet goes silent."""
        self._silence()
        for running in self._pods.values():
            for c in running.containers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.process.pid, signal.SIGSTOP)
            for pid in run_pids(running.uid, POD_UID_ENV):  # those in sessions of their own
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGSTOP)
        log.info("event=node_hung node=%s pods=%d", self.node, len(self._pods))

    def stop(self) -> None:
        """Stop the agent; pods still running (or stopped) are killed (the end of the test
        cluster)."""
        self.power_off()

    def log_path(self, ns: str, name: str, container: str) -> Path | None:
        """The log file of a pod's container on this node (it stays after the pod ends)."""
        found = sorted((self.root / "pods").glob(f"{ns}_{name}_*/{container}.log"))
        return found[-1] if found else None
