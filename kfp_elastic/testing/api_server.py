"""A fake Kubernetes API server for pods, speaking real HTTP on 127.0.0.1.

The real ``kubernetes`` client runs against it unchanged. It keeps what a controller depends on:
a monotonic resourceVersion on every object, list and event; create/get/list/delete/patch with
the real Status errors (404 NotFound, 409 AlreadyExists/Conflict, 422 Invalid, 403 from the
Priority and ServiceAccount admission plugins); every body's fields checked as the API server's
decoder checks them, honouring ``fieldValidation`` (``api_validation``); label selectors and the
field selectors on the pod fields kube-apiserver allows (``api_wire.POD_FIELDS``; another field
is a 400 ``field label not supported``), pods of every namespace (``/api/v1/pods``); graceful
deletion of scheduled pods (deletionTimestamp, then the kubelet's terminal status, then
DELETED); and watches that stream JSON lines from any retained resourceVersion (history bounded
by count and, optionally, age), or one ERROR event with a 410 Status when asked for compacted
history; they end at ``timeoutSeconds`` or the server's own limit and get BOOKMARKs when they
ask. A watch-list request (``sendInitialEvents=true``, what kubectl's waits send) gets the
current objects as ADDED, then the BOOKMARK annotated ``k8s.io/initial-events-end``.
``pods/log`` serves what the test cluster's kubelets captured (``tailLines``, ``follow``);
discovery and the Tables of every kind (``kubectl get``) come from ``api_discovery`` and
``api_tables``.

Requests are authenticated (service-account tokens it issued; none or an admin token is the
harness), may impersonate (``Impersonate-User``, ``kubectl --as``) and are authorized by RBAC
from the stored Roles and bindings (403 Forbidden), which also answers (Self)SubjectAccessReviews
(``kubectl auth can-i``); the eviction
subresource honours PodDisruptionBudgets (429). The decisions are in ``api_rules``.

Besides pods it stores PriorityClasses (``spec.priority`` and ``preemptionPolicy`` resolved on pod
create; the DefaultTolerationSeconds admission adds 300 s not-ready/unreachable tolerations to
pods without their own), ConfigMaps, Secrets, Nodes, RBAC objects, PodDisruptionBudgets,
StatefulSets, ReplicaSets (with their ``scale`` subresource), Namespaces, ServiceAccounts (pod
admission finds them), Services, NetworkPolicies, Events, CustomResourceDefinitions and the
custom resources of their kinds (``api_crds``: served in every version a CRD serves, checked
against its schema)
(create/get/list/watch/replace/delete; patches JSON, merge, strategic merge and server-side
apply, ``api_wire.patched`` and ``api_apply.server_side_apply``, with conflicts and the
managedFields of every write, ``api_apply``; ``dryRun=All``: answered, nothing stored; field
selectors per kind
(``api_wire.SELECTABLE_FIELDS``); their watches keep a history of their own), and
garbage-collects: removing any object deletes the pods and objects whose ownerReferences name
its uid. With ``tls`` it serves
HTTPS (what ``load_incluster_config()`` demands). Scheduling gates: a pod created with
``spec.schedulingGates`` gets ``PodScheduled=False``, reason ``SchedulingGated``; a patch may
remove gates, never add one (422). ``pod_mutators`` stand for mutating admission webhooks. Test
hooks play scheduler, kubelet and node lifecycle by hand; ``testing/cluster/`` plays them for
real; they record their Events with :meth:`FakeKubernetes.record_event` (also readable as
``events.k8s.io/v1``).
"""

from __future__ import annotations

import base64
import copy
import itertools
import logging
import math
import re
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from kfp_elastic.testing import api_crds, api_validation
from kfp_elastic.testing.api_apply import server_side_apply, update_managed_fields
from kfp_elastic.testing.api_events import new_event
from kfp_elastic.testing.api_rules import (
    User,
    access_review,
    authorized,
    budget_status,
    eviction_decision,
    forbidden_message,
    impersonated,
    impersonation_calls,
    selects,
    service_account_user,
)
from kfp_elastic.testing.api_validation import check_applied, check_body, check_patched
from kfp_elastic.testing.api_wire import (
    CLUSTER_SCOPED,
    OBJECT_KINDS,
    STRATEGIC_MERGE_PATCH,
    ApiCall,
    ApiError,
    FieldSelector,
    Handler,
    Server,
    fields_match,
    labels_match,
    merge_patch,
    now_timestamp,
    parse_field_selector,
    parse_label_selector,
    patched,
)

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 1800.0  # kube-apiserver --min-request-timeout
BOOKMARK_S = 60.0  # about how often kube-apiserver sends a watch a BOOKMARK

# manifests/base/priorityclasses.yaml's (tests/unit/deploy/test_manifests.py compares them).
PRIORITY_CLASSES = {
    "kfp-elastic-worker-guaranteed": (-3, "PreemptLowerPriority"),
    "kfp-elastic-worker-opportunistic": (-5, "Never"),
    "kfp-elastic-worker-low": (-5, "Never"),
    "kfp-elastic-worker-level-0": (-2, "PreemptLowerPriority"),
    "kfp-elastic-worker-level-1": (-3, "PreemptLowerPriority"),
    "kfp-elastic-worker-level-2": (-4, "PreemptLowerPriority"),
    "kfp-elastic-control": (100000, "PreemptLowerPriority"),
    "system-cluster-critical": (2000000000, "PreemptLowerPriority"),
}
SERVICE_ACCOUNTS = {"default", "kfp-elastic-worker", "kfp-elastic-master"}
# The namespaces every cluster has (the cluster's own is added); others are created by clients.
NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
# Those the NamespaceLifecycle admission plugin never lets anyone delete.
IMMORTAL_NAMESPACES = ("default", "kube-system", "kube-public")
# kube-apiserver --default-not-ready-toleration-seconds / --default-unreachable-toleration-seconds
DEFAULT_TOLERATION_SECONDS = 300
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# The controller kinds whose replicas a PodDisruptionBudget counts: kind -> resource.
_CONTROLLERS = {"StatefulSet": "statefulsets", "ReplicaSet": "replicasets"}
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class FakeKubernetes:
    """``with FakeKubernetes() as k8s:`` serves at ``k8s.url`` until the block ends."""

    def __init__(
        self,
        *,
        history: int = 1000,
        priority_classes: dict | None = None,
        service_accounts: set[str] | None = None,
        kubelet: bool = True,
        namespace: str = "default",
        validate_pods: bool = True,
        tls: tuple[str, str] | None = None,
        default_toleration_seconds: int | None = DEFAULT_TOLERATION_SECONDS,
        admin_tokens: tuple[str, ...] = (),
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        compaction_s: float | None = None,
        bookmark_s: float = BOOKMARK_S,
        max_events: int = 2000,
    ) -> None:
        """``kubelet=False``: deleted scheduled pods stay Terminating until a kubelet (a test
        hook or :mod:`kfp_elastic.testing.cluster.kubelet`) finishes them. ``tls``: (certificate,
        key) PEM files to serve HTTPS with. ``default_toleration_seconds``: what the
        DefaultTolerationSeconds admission plugin gives a pod that does not tolerate the
        not-ready and unreachable NoExecute taints itself (None: the plugin is off).
        ``admin_tokens``: bearer tokens that may do anything, as a request without a token may
        (the harness); a token from :meth:`service_account_token` is its service account,
        authorized by RBAC. ``validate_pods=False``: pod bodies skip the field validation
        (``api_validation``) that every other kind's get.

        Watches: ``watch_timeout_s`` ends a watch that asked for no ``timeoutSeconds`` (the API
        server's ``--min-request-timeout``, 1800 s) and caps those that did (what an API server
        restart or a proxy's idle timeout does to a long watch). ``compaction_s``: events older
        than this are forgotten (the API server compacts etcd every 5 min; None: only the last
        ``history`` events are kept), so watching from before them gets 410 Gone.
        ``bookmark_s``: how often a watch with ``allowWatchBookmarks=true`` gets a BOOKMARK (the
        API server's is about a minute), and one comes just before it times out."""
        self._cond = threading.Condition()
        self._rv = 100
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        # every other kind: (resource, namespace or "", name) -> object
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._events: deque[tuple[str, str]] = deque()  # recorded events, oldest first
        self.max_events = max_events
        # resourceVersions spent on Events: no controller acts on them, so they wake none
        self._event_writes = 0
        self._last_event_ns = 0
        # (resourceVersion, namespace, type, old, new, time.monotonic() when recorded)
        self._history: deque[tuple[int, str, str, dict | None, dict, float]] = deque()
        self._max_history = history
        self.watch_timeout_s = watch_timeout_s
        self.compaction_s = compaction_s
        self.bookmark_s = bookmark_s
        self._admin_tokens = set(admin_tokens)
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (namespace, service account)
        self._floor = self._rv  # watches from a resourceVersion below this get 410
        # the same for every other kind's changes (each entry's objects carry their kind)
        self._object_history: deque[tuple[int, str, str, dict | None, dict, float]] = deque()
        self._object_floor = self._rv
        self._streams: set[_Stream] = set()
        self._held = self._stopping = False
        self._ips = itertools.count(10)
        self._service_ips = itertools.count(10)
        # api_crds.Validation per (CRD uid, its resourceVersion, version)
        self._custom_validations: dict[tuple[str, str, str], api_crds.Validation] = {}
        for name, (value, policy) in (
            PRIORITY_CLASSES if priority_classes is None else priority_classes
        ).items():
            self.create_object(
                "priorityclasses",
                "",
                {"metadata": {"name": name}, "value": value, "preemptionPolicy": policy},
            )
        for name in dict.fromkeys((*NAMESPACES, namespace)):
            self.create_object("namespaces", "", {"metadata": {"name": name}})
        self.validate_pods = validate_pods
        self.default_toleration_seconds = default_toleration_seconds
        self.service_accounts = SERVICE_ACCOUNTS if service_accounts is None else service_accounts
        self.namespace = namespace  # what the test hooks act on by default
        # Mutating admission webhooks: each is called with (namespace, pod) on every pod create,
        # before validation, and may change the pod in place (the Kueue stand-in gates pods).
        self.pod_mutators: list[Callable[[str, dict[str, Any]], None]] = []
        # pods/log: (namespace, pod, container) -> what it wrote, None before it started (the
        # test cluster reads its kubelets' files)
        self.pod_logs: Callable[[str, str, str], str | None] | None = None
        self.kubelet = kubelet  # False: deleted scheduled pods stay Terminating until finished
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        # The same requests as RBAC sees them (verb, group, resource, subresource): what a Role
        # must allow (tests/e2e/test_master_rbac.py compares it with manifests/base/rbac.yaml).
        self.api_calls: list[ApiCall] = []
        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.fake = self
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fake-k8s", kwargs={"poll_interval": 0.05}
        )
        self._thread.start()

    def __enter__(self) -> FakeKubernetes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- storage -------------------------------------------------------------------------

    def _record(self, ns: str, kind: str, old: dict | None, new: dict) -> dict:
        """Give ``new`` the next resourceVersion and store the event (lock held)."""
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            self._pods.pop((ns, new["metadata"]["name"]), None)
        else:
            self._pods[(ns, new["metadata"]["name"])] = new
        self._history.append(
            (self._rv, ns, kind, copy.deepcopy(old), copy.deepcopy(new), time.monotonic())
        )
        while len(self._history) > self._max_history:
            self._floor = self._history.popleft()[0]
        self._expire_history()
        self._cond.notify_all()
        if kind == "DELETED":
            self._collect_dependents(new["metadata"]["uid"])
            self._finalize_namespace(ns)
        return copy.deepcopy(new)

    def _expire_history(self) -> None:
        """Compaction by age (lock held): forget the events older than ``compaction_s``."""
        if self.compaction_s is None:
            return
        horizon = time.monotonic() - self.compaction_s
        while self._history and self._history[0][5] < horizon:
            self._floor = self._history.popleft()[0]
        while self._object_history and self._object_history[0][5] < horizon:
            self._object_floor = self._object_history.popleft()[0]

    def _record_object(self, ns: str, kind: str, old: dict | None, new: dict) -> None:
        """Keep a change of a non-pod object for its watches (lock held, ``new`` already has
        the current resourceVersion)."""
        self._object_history.append(
            (self._rv, ns, kind, copy.deepcopy(old), copy.deepcopy(new), time.monotonic())
        )
        while len(self._object_history) > self._max_history:
            self._object_floor = self._object_history.popleft()[0]
        self._expire_history()

    def _collect_dependents(self, owner_uid: str) -> None:
        """The garbage collector (background propagation): the owner is gone, so delete every
        pod and object whose ownerReferences name it (lock held; the lock is reentrant)."""

        def owned(obj: dict[str, Any]) -> bool:
            refs = obj["metadata"].get("ownerReferences") or []
            return any(ref.get("uid") == owner_uid for ref in refs)

        pods = [(ns, name) for (ns, name), pod in self._pods.items() if owned(pod)]
        objects = [key for key, obj in self._objects.items() if owned(obj)]
        for ns, name in pods:
            if (ns, name) in self._pods:
                self.delete(ns, name)
        for resource, ns, name in objects:
            if (resource, ns, name) in self._objects:
                self.delete_object(resource, ns, name)

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until anything (pods or other objects, Events aside) changed after the change
        count ``seen`` or ``timeout`` passed; the current change count (0 at first). What the
        scheduler and kubelets of the test cluster wait on instead of watching over HTTP."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._rv - self._event_writes > seen or self._stopping, timeout
            )
            return self._rv - self._event_writes

    def pods_snapshot(self) -> list[dict[str, Any]]:
        """Copies of every pod in every namespace."""
        with self._cond:
            return [copy.deepcopy(p) for p in self._pods.values()]

    # -- custom resources: the kinds of the stored CustomResourceDefinitions (api_crds) ----

    def custom_kinds(self) -> dict[str, api_crds.CustomKind]:
        """resource -> the custom kind of each stored CRD."""
        with self._cond:
            crds = [o for (r, _, _), o in self._objects.items() if r == api_crds.RESOURCE]
        return api_crds.custom_kinds(crds)

    def object_kinds(self) -> tuple[dict[str, tuple[str, str]], set[str]]:
        """What the server routes besides pods: resource -> (kind, apiVersion), built-in and
        custom (in its storage version); the cluster-scoped resources among them."""
        custom = self.custom_kinds()
        kinds = {**OBJECT_KINDS, **{r: (c.kind, c.api_version()) for r, c in custom.items()}}
        scoped = CLUSTER_SCOPED | {r for r, c in custom.items() if not c.namespaced}
        return kinds, scoped

    def custom_discovery(self) -> dict[str, list[dict[str, Any]]]:
        """groupVersion -> the APIResources of the custom kinds (``api_discovery``)."""
        return api_crds.discovery_resources(self.custom_kinds().values())

    def custom_schemas(self) -> dict[str, dict[str, dict[str, Any]]]:
        """groupVersion -> kind -> the ``openAPIV3Schema`` of each custom kind served in it
        (``api_discovery``'s OpenAPI documents)."""
        return api_crds.openapi_schemas(self.custom_kinds().values())

    def serve_custom(self, resource: str, version: str) -> bool:
        """Whether ``resource`` is a custom kind; if so, the request being served is for it
        in ``version`` (404 for a version it does not serve, warnings for a deprecated one)."""
        custom = self.custom_kinds().get(resource)
        if custom is not None:
            api_crds.begin_request(custom, version)
        return custom is not None

    def _taken_plurals(self, crd_name: str) -> set[str]:
        """The resources a CRD named ``crd_name`` may not serve: the built-in ones and those of
        the other CRDs (the stores are keyed by plural)."""
        with self._cond:
            others = [
                o["spec"]["names"]["plural"]
                for (r, _, name), o in self._objects.items()
                if r == api_crds.RESOURCE and name != crd_name
            ]
        return {*OBJECT_KINDS, "pods", *others}

    def _kind(self, resource: str) -> tuple[str, str]:
        """(kind, apiVersion) of a stored resource; a custom kind's in the version the request
        being served names."""
        if resource in OBJECT_KINDS:
            return OBJECT_KINDS[resource]
        custom = self.custom_kinds().get(resource)
        if custom is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return custom.kind, custom.api_version(api_crds.served_version(custom))

    def _validation(self, resource: str) -> Any:
        """The field validation of ``resource``: ``api_validation`` for a built-in kind, the
        CRD's schema of the request's version for a custom one (``api_crds.Validation``)."""
        if resource in OBJECT_KINDS:
            return api_validation
        custom = self.custom_kinds()[resource]
        version = api_crds.served_version(custom)
        crd = self._objects[(api_crds.RESOURCE, "", f"{resource}.{custom.group}")]
        key = (crd["metadata"]["uid"], crd["metadata"]["resourceVersion"], version)
        if key not in self._custom_validations:
            self._custom_validations[key] = api_crds.Validation(custom, version)
        return self._custom_validations[key]

    # -- other kinds: priority classes, config maps, secrets, nodes -----------------------

    def create_object(
        self,
        resource: str,
        ns: str,
        obj: dict[str, Any],
        *,
        manager: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Create an object; ``manager``: the field manager whose ``Update`` entry owns what it
        sent (None: managedFields as given, the test cluster's own writes); ``dry_run``: the
        object as it would be created (no resourceVersion), nothing stored."""
        kind, api_version = self._kind(resource)
        obj = copy.deepcopy(self._validation(resource).check_body(kind, api_version, obj))
        if manager is not None:
            obj.setdefault("kind", kind)
            obj = update_managed_fields(None, obj, manager, api_version, now_timestamp())
        meta = obj.setdefault("metadata", {})
        name = meta.get("name", "")
        self._admit_to_namespace(resource, ns, name)
        if not name or len(name) > 253 or not _NAME.fullmatch(name):
            raise ApiError(
                422, "Invalid", f"{kind} {name!r} is invalid: metadata.name: Invalid value"
            )
        if resource == "secrets":  # the API server stores stringData base64-encoded in data
            for key, value in (obj.pop("stringData", None) or {}).items():
                obj.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()
        _check_namespace(meta, ns)
        if resource == "priorityclasses":
            obj.setdefault("preemptionPolicy", "PreemptLowerPriority")
        if resource == "namespaces":
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        if resource == "services":
            self._allocate_cluster_ip(obj.setdefault("spec", {}))
        if resource == api_crds.RESOURCE:
            api_crds.prepare(obj, self._taken_plurals(name))
        _validate_object(resource, kind, name, obj)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_timestamp(), generation=1)
        if ns:
            meta["namespace"] = ns
        obj.update(apiVersion=api_version, kind=kind)
        with self._cond:
            if (resource, ns, name) in self._objects:
                raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
            if dry_run:
                return copy.deepcopy(obj)
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._objects[(resource, ns, name)] = obj
            self._record_object(ns, "ADDED", None, obj)
            self._cond.notify_all()
            return copy.deepcopy(obj)

    def _allocate_cluster_ip(self, spec: dict[str, Any]) -> None:
        """A Service's defaults: type ClusterIP, an address from the service range unless
        headless (``clusterIP: None``)."""
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if not spec.get("clusterIP"):
            n = next(self._service_ips)
            spec["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
        spec["clusterIPs"] = [spec["clusterIP"]]
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))

    def get_object(self, resource: str, ns: str, name: str) -> dict[str, Any]:
        with self._cond:
            if (resource, ns, name) not in self._objects:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            return self._with_status(resource, copy.deepcopy(self._objects[(resource, ns, name)]))

    def list_objects(
        self, resource: str, ns: str, labels: str = "", fields: FieldSelector | None = None
    ) -> dict[str, Any]:
        """The objects of ``resource`` in ``ns`` ("": every namespace, or a cluster-scoped
        kind) matching the label selector ``labels`` and the field selector ``fields``."""
        selector = parse_label_selector(labels)
        with self._cond:
            items = [
                self._with_status(resource, copy.deepcopy(obj))
                for (_, n, _), obj in sorted(
                    (key, obj) for key, obj in self._objects.items() if key[0] == resource
                )
                if ns in ("", n)
                and labels_match(selector, obj["metadata"].get("labels") or {})
                and fields_match(fields or [], obj)
            ]
            rv = str(self._rv)
        kind, api_version = self._kind(resource)
        return {
            "kind": f"{kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    def replace_object(
        self,
        resource: str,
        ns: str,
        obj: dict[str, Any],
        *,
        manager: str | None = None,
        dry_run: bool = False,
        subresource: str = "",
    ) -> dict[str, Any]:
        """PUT: the whole object replaced; uid and creationTimestamp kept. ``manager``: the field
        manager whose ``Update`` entry (through ``subresource``) owns what it changed (None:
        managedFields as given, else kept: the test cluster's own writes); ``dry_run``: the
        object as it would be stored, nothing stored."""
        kind, api_version = self._kind(resource)
        obj = self._validation(resource).check_body(kind, api_version, obj)
        name = obj.get("metadata", {}).get("name", "")
        if resource == api_crds.RESOURCE:
            api_crds.prepare(obj, self._taken_plurals(name))
        _validate_object(resource, kind, name, obj)
        with self._cond:
            old = self.get_object(resource, ns, name)
            if manager is not None:
                obj = update_managed_fields(
                    old, obj, manager, old["apiVersion"], now_timestamp(), subresource
                )
            elif "managedFields" not in obj.get("metadata", {}) and "managedFields" in old.get(
                "metadata", {}
            ):
                kept = old["metadata"]["managedFields"]
                obj = {**obj, "metadata": {**obj["metadata"], "managedFields": kept}}
            return self._replace(resource, ns, old, obj, dry_run)

    def _replace(
        self, resource: str, ns: str, old: dict[str, Any], obj: dict[str, Any], dry_run: bool
    ) -> dict[str, Any]:
        """(lock held) Store ``obj`` in place of ``old`` (uid and creationTimestamp kept) with
        the next resourceVersion; a dry run: the object with ``old``'s, nothing stored."""
        with self._cond:
            name = old["metadata"]["name"]
            new = copy.deepcopy(obj)
            # the generation counts changes of what the object asks for, not of its metadata
            # or status (what a status subresource writes)
            asked = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
            was = {k: v for k, v in old.items() if k not in ("metadata", "status")}
            new["metadata"] = {
                **new["metadata"],
                **{k: old["metadata"][k] for k in ("uid", "creationTimestamp")},
                "generation": old["metadata"].get("generation", 1) + (asked != was),
            }
            new.update(apiVersion=old["apiVersion"], kind=old["kind"])
            if ns:
                new["metadata"]["namespace"] = ns
            if dry_run:
                new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                return new
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._objects[(resource, ns, name)] = new
            self._record_object(ns, "MODIFIED", old, new)
            self._cond.notify_all()
            return copy.deepcopy(new)

    def patch_object(
        self,
        resource: str,
        ns: str,
        name: str,
        body: Any,
        patch_type: str,
        *,
        manager: str | None = None,
        dry_run: bool = False,
        subresource: str = "",
    ) -> dict[str, Any]:
        """PATCH of a stored object (``kubectl cordon`` patches a node, ``kubectl apply``
        what it applied): a JSON, merge or strategic merge patch (``api_wire.patched``),
        applied as a replacement (:meth:`replace_object`'s ``manager``, ``dry_run`` and
        ``subresource``). Server-side apply goes to :meth:`apply_object`."""
        with self._cond:
            old = self.get_object(resource, ns, name)
            new = patched(old, body, patch_type)
            strategic = patch_type == STRATEGIC_MERGE_PATCH
            kind = self._kind(resource)
            new = self._validation(resource).check_patched(*kind, new, body, strategic)
            _check_unchanged(resource, kind, name, old, new)
            if new == old:  # nothing to write: the resourceVersion stays (kubectl: no change)
                return old
            return self.replace_object(
                resource, ns, new, manager=manager, dry_run=dry_run, subresource=subresource
            )

    def apply_object(
        self,
        resource: str,
        ns: str,
        name: str,
        body: dict[str, Any],
        manager: str,
        *,
        force: bool = False,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Server-side apply (``api_apply.server_side_apply``, conflicts unless ``force``): the
        object created from ``body`` if there is none, else ``body``'s fields merged into it;
        (the object, whether created). ``dry_run``: nothing stored."""
        kind = self._kind(resource)
        _check_applied(kind, name, body)
        self._validation(resource).check_applied(*kind, ns, name, body)
        with self._cond:
            live = None
            if (resource, ns, name) in self._objects:
                live = self.get_object(resource, ns, name)
            new = server_side_apply(live, body, manager, now_timestamp(), force)
            if live is None:
                return self.create_object(resource, ns, new, dry_run=dry_run), True
            _check_unchanged(resource, kind, name, live, new)
            if new == live:  # nothing to write: the resourceVersion stays
                return live, False
            _validate_object(resource, kind[0], name, new)
            return self._replace(resource, ns, live, new, dry_run), False

    def delete_object(
        self, resource: str, ns: str, name: str, *, dry_run: bool = False
    ) -> dict[str, Any]:
        """Delete an object (and, by the garbage collector, what it owns); ``dry_run``: the
        object as it is, nothing deleted."""
        with self._cond:
            if (resource, ns, name) not in self._objects:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            if dry_run:
                return self.get_object(resource, ns, name)
            if resource == "namespaces":
                return self._terminate_namespace(name)
            obj = self._objects.pop((resource, ns, name))
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._record_object(ns, "DELETED", obj, obj)
            self._cond.notify_all()
            self._collect_dependents(obj["metadata"]["uid"])
            if resource == api_crds.RESOURCE:  # its custom resources go with it
                plural = obj["spec"]["names"]["plural"]
                for key in [k for k in self._objects if k[0] == plural]:
                    self.delete_object(*key)
            return copy.deepcopy(obj)

    # -- namespaces: the NamespaceLifecycle admission plugin and the namespace controller ----

    def _admit_to_namespace(self, resource: str, ns: str, name: str) -> None:
        """NamespaceLifecycle on a create in ``ns`` ("": cluster-scoped, always admitted): 404
        for a namespace that does not exist, 403 for one being terminated."""
        if not ns:
            return
        with self._cond:
            namespace = self._objects.get(("namespaces", "", ns))
        if namespace is None:
            error = ApiError(404, "NotFound", f'namespaces "{ns}" not found')
            error.status["details"] = {"name": ns, "kind": "namespaces"}
            raise error
        if namespace["status"].get("phase") == "Terminating":
            group = "" if resource == "pods" else self._kind(resource)[1].rpartition("/")[0]
            error = ApiError(
                403,
                "Forbidden",
                f'{resource}{"." + group if group else ""} "{name}" is forbidden: unable to '
                f"create new content in namespace {ns} because it is being terminated",
            )
            error.status["details"] = {
                "name": name,
                **({"group": group} if group else {}),
                "kind": resource,
                "causes": [
                    {
                        "reason": "NamespaceTerminating",
                        "message": f"namespace {ns} is being terminated",
                        "field": "metadata.namespace",
                    }
                ],
            }
            raise error

    def _terminate_namespace(self, name: str) -> dict[str, Any]:
        """DELETE of a namespace (lock held): the ``kubernetes`` finalizer keeps it, Terminating,
        while the namespace controller deletes everything in it (pods gracefully, as a pod
        delete does); it is gone once the last of its pods is. The immortal namespaces are
        refused (403), a namespace already terminating is a 409, as kube-apiserver words them."""
        if name in IMMORTAL_NAMESPACES:
            raise ApiError(
                403,
                "Forbidden",
                f'namespaces "{name}" is forbidden: this namespace may not be deleted',
            )
        old = self._objects[("namespaces", "", name)]
        if old["metadata"].get("deletionTimestamp"):
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on namespaces "{name}": The system is ensuring '
                "all content is removed from this namespace.  Upon completion, this namespace "
                "will automatically be purged by the system.",
            )
        new = copy.deepcopy(old)
        new["metadata"]["deletionTimestamp"] = now_timestamp()
        new["status"]["phase"] = "Terminating"
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[("namespaces", "", name)] = new
        self._record_object("", "MODIFIED", old, new)
        self._cond.notify_all()
        for resource, ns, obj_name in sorted(self._objects):
            if ns == name and (resource, ns, obj_name) in self._objects:
                self.delete_object(resource, ns, obj_name)
        for ns, pod_name in sorted(self._pods):
            if ns == name and (ns, pod_name) in self._pods:
                self.delete(ns, pod_name)
        self._finalize_namespace(name)
        return copy.deepcopy(new)

    def _finalize_namespace(self, name: str) -> None:
        """The namespace controller's last step (lock held): a terminating namespace with
        nothing left in it is removed."""
        namespace = self._objects.get(("namespaces", "", name))
        if namespace is None or namespace["status"].get("phase") != "Terminating":
            return
        if any(ns == name for ns, _ in self._pods) or any(k[1] == name for k in self._objects):
            return
        del self._objects[("namespaces", "", name)]
        namespace["spec"]["finalizers"] = []
        self._rv += 1
        namespace["metadata"]["resourceVersion"] = str(self._rv)
        self._record_object("", "DELETED", namespace, namespace)
        self._cond.notify_all()
        log.info("event=namespace_deleted namespace=%s", name)

    def record_event(
        self,
        involved: dict[str, Any],
        reason: str,
        message: str,
        *,
        component: str,
        event_type: str = "Normal",
        host: str = "",
        field_path: str = "",
    ) -> None:
        """A component's event recorder: store a core/v1 Event about ``involved`` (a pod or
        node as stored). The oldest are dropped beyond ``max_events`` (kube-apiserver keeps
        events for an hour, ``--event-ttl``)."""
        event = new_event(
            involved,
            reason,
            message,
            component=component,
            now=now_timestamp(),
            now_ns=self._event_ns(),
            event_type=event_type,
            host=host,
            field_path=field_path,
        )
        meta = event["metadata"]
        with self._cond:
            before = self._rv
            try:
                self.create_object("events", meta["namespace"], event)
            except ApiError as error:  # a recorder drops what the server refuses (a namespace
                # being terminated), as client-go's does
                log.info("event=event_refused reason=%s message=%s", reason, error)
                return
            self._events.append((meta["namespace"], meta["name"]))
            while len(self._events) > self.max_events:
                ns, name = self._events.popleft()
                if ("events", ns, name) in self._objects:
                    self.delete_object("events", ns, name)
            self._event_writes += self._rv - before

    def _event_ns(self) -> int:
        """Now in Unix nanoseconds, later than every event's before."""
        with self._cond:
            self._last_event_ns = max(time.time_ns(), self._last_event_ns + 1)
            return self._last_event_ns

    def events(self, name: str | None = None, ns: str = "") -> list[dict[str, Any]]:
        """The stored events (about the object called ``name``), oldest first."""
        listed = self.list_objects("events", ns)["items"]
        return sorted(
            (e for e in listed if name in (None, e["involvedObject"].get("name"))),
            key=lambda e: int(e["metadata"]["resourceVersion"]),
        )

    # -- RBAC: who a token is, what it may do ---------------------------------------------

    def service_account_token(self, ns: str, service_account: str) -> str:
        """The token the kubelet mounts into a pod running as ``ns/service_account`` (the
        TokenRequest API's answer; one per account here, never expiring)."""
        with self._cond:
            for token, owner in self._tokens.items():
                if owner == (ns, service_account):
                    return token
            token = f"sa-{uuid.uuid4().hex}"
            self._tokens[token] = (ns, service_account)
            return token

    def authenticate(self, authorization: str) -> User | None:
        """The user of a request's ``Authorization`` header: None (the harness, allowed
        everything) without a token or with an admin token; 401 for a token nobody issued."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":  # the in-cluster config writes "bearer"
            raise ApiError(401, "Unauthorized", "Unauthorized")
        token = token.strip()
        if token in self._admin_tokens:
            return None
        with self._cond:
            owner = self._tokens.get(token)
        if owner is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return service_account_user(*owner)

    def authorize(self, user: User | None, call: ApiCall) -> None:
        """RBAC from the stored Roles, ClusterRoles and bindings: 403 unless one grants
        ``call``."""
        if user is None:
            return
        with self._cond:
            allowed = authorized(user, call, self._objects)
        if not allowed:
            error = ApiError(403, "Forbidden", forbidden_message(user, call))
            error.status["details"] = {
                "group": call.group,
                "kind": call.resource,
                **({"name": call.name} if call.name else {}),
            }
            raise error

    def impersonate(self, user: User | None, name: str | None, groups: list[str]) -> User | None:
        """The user a request acts as with ``Impersonate-User``/``Impersonate-Group`` headers
        (``kubectl --as``): the impersonator must be allowed to ``impersonate`` them (403 as
        RBAC words it); without the headers, ``user`` itself."""
        if not name:
            if groups:
                raise ApiError(
                    500, "InternalError", "requested impersonation of groups without a user"
                )
            return user
        for call in impersonation_calls(name, groups):
            self.authorize(user, call)
        return impersonated(name, groups)

    def review_access(self, user: User | None, review: dict[str, Any]) -> dict[str, Any]:
        """POST of a SelfSubjectAccessReview (about ``user``) or a SubjectAccessReview (about
        its ``spec.user`` and ``spec.groups``): the review with RBAC's answer as its status;
        nothing is stored."""
        spec = review.get("spec") or {}
        if review.get("kind") == "SubjectAccessReview":
            if not spec.get("user") and not spec.get("groups"):
                raise ApiError(
                    422,
                    "Invalid",
                    'SubjectAccessReview.authorization.k8s.io "" is invalid: spec.user: '
                    'Invalid value: "": at least one of user or group must be specified',
                )
            user = User(spec.get("user", ""), tuple(spec.get("groups") or ()))
        with self._cond:
            status = access_review(user, spec, self._objects)
        return {**review, "metadata": review.get("metadata") or {}, "status": status}

    # -- PodDisruptionBudgets and the eviction API ----------------------------------------

    def _with_status(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """A PodDisruptionBudget's status, computed from the pods now (what the disruption
        controller keeps up to date; lock is reentrant)."""
        if resource == "poddisruptionbudgets":
            with self._cond:
                obj["status"] = self._budget_status(obj)
        if resource not in OBJECT_KINDS:  # a custom resource, in the request's version
            obj["apiVersion"] = self._kind(resource)[1]
        return obj

    def _budget_status(self, pdb: dict[str, Any]) -> dict[str, Any]:
        """(lock held) The budget's status; expected pods are the replicas of the StatefulSets
        and ReplicaSets that own the selected pods (the controller kinds the fake stores)."""
        pods = list(self._pods.values())
        replicas: dict[str, int] | None = {}
        for pod in pods:
            if not selects(pdb, pod):
                continue
            owner = next(
                (r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")),
                None,
            )
            resource = _CONTROLLERS.get((owner or {}).get("kind", ""), "")
            key = (resource, pod["metadata"]["namespace"], (owner or {}).get("name", ""))
            controller = self._objects.get(key)
            if controller is None:
                replicas = None
                break
            replicas[key[2]] = controller.get("spec", {}).get("replicas", 1)
        expected = None if replicas is None else sum(replicas.values())
        return budget_status(pdb, pods, expected)

    def create_eviction(
        self, ns: str, name: str, eviction: dict[str, Any] | None = None, *, dry_run: bool = False
    ) -> dict[str, Any]:
        """POST pods/{name}/eviction: refused with 429 while the pod's budget allows no
        disruption; otherwise the pod gets DisruptionTarget (EvictionByEvictionAPI) and is
        deleted gracefully with the Eviction's deleteOptions. ``dry_run`` (or ``dryRun: [All]``
        in the deleteOptions): the same answer, the pod left alone."""
        options = (eviction or {}).get("deleteOptions") or {}
        dry_run = dry_run or "All" in (options.get("dryRun") or [])
        with self._cond:
            pod = self._get(ns, name)
            budgets = [
                (obj["metadata"]["name"], self._budget_status(obj))
                for (r, _, _), obj in sorted(
                    (key, obj)
                    for key, obj in self._objects.items()
                    if key[0] == "poddisruptionbudgets"
                )
                if selects(obj, pod)
            ]
            decision = eviction_decision(pod, budgets)
            if not decision.delete:
                error = ApiError(decision.code, decision.reason, decision.message)
                if decision.cause:
                    error.status["details"] = {
                        "causes": [{"reason": "DisruptionBudget", "message": decision.cause}]
                    }
                raise error
            if not pod["metadata"].get("deletionTimestamp") and not dry_run:
                if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                    self._disrupt(name, "EvictionByEvictionAPI", "Eviction API: evicting", ns)
                grace = options.get("gracePeriodSeconds")
                self.delete(ns, name, grace, options.get("preconditions"))
        if not dry_run:
            log.info("event=pod_evicted pod=%s/%s", ns, name)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }

    @property
    def priority_classes(self) -> dict[str, tuple[int, str]]:
        """name -> (value, preemptionPolicy) of every PriorityClass."""
        with self._cond:
            return {
                name: (obj["value"], obj["preemptionPolicy"])
                for (r, _, name), obj in self._objects.items()
                if r == "priorityclasses"
            }

    def _get(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self._pods:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        return self._pods[(ns, name)]

    def create(
        self, ns: str, pod: dict[str, Any], dry_run: bool = False, *, manager: str | None = None
    ) -> dict[str, Any]:
        """Create a pod (admission, validation, defaults); ``dry_run``: the pod as it would be
        created (no resourceVersion), nothing stored; ``manager``: the field manager whose
        ``Update`` entry owns what it sent (None: managedFields as given)."""
        pod = copy.deepcopy(check_body("Pod", "v1", pod) if self.validate_pods else pod)
        if manager is not None:
            pod.setdefault("kind", "Pod")
            pod = update_managed_fields(None, pod, manager, "v1", now_timestamp())
        meta, spec = pod.setdefault("metadata", {}), pod.setdefault("spec", {})
        _check_namespace(meta, ns)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name", "")
        self._admit_to_namespace("pods", ns, name)
        for mutate in self.pod_mutators:
            mutate(ns, pod)
        problems = []
        if spec.get("nodeName") and spec.get("schedulingGates"):
            problems.append(
                "spec.nodeName: Forbidden: cannot be set until all schedulingGates have been "
                "cleared"
            )
        if not name or len(name) > 253 or not _NAME.fullmatch(name):
            problems.append(f"metadata.name: Invalid value: {name!r}")
        if not spec.get("containers"):
            problems.append("spec.containers: Required value")
        for i, c in enumerate(spec.get("containers") or []):
            problems += [
                f"spec.containers[{i}].{k}: Required value"
                for k in ("name", "image")
                if not c.get(k)
            ]
        if spec.get("restartPolicy", "Always") not in ("Always", "OnFailure", "Never"):
            problems.append("spec.restartPolicy: Unsupported value")
        if problems:
            raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: ' + ", ".join(problems))
        pc = spec.get("priorityClassName")
        priority_classes = self.priority_classes
        if pc is not None and pc not in priority_classes:
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: no PriorityClass with name {pc} was found',
            )
        sa = spec.setdefault("serviceAccountName", "default")
        if sa not in self.service_accounts and ("serviceaccounts", ns, sa) not in self._objects:
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: error looking up '
                f'service account {ns}/{sa}: serviceaccount "{sa}" not found',
            )
        spec["serviceAccount"] = sa
        if pc is not None:
            spec["priority"], spec["preemptionPolicy"] = priority_classes[pc]
        else:  # no class and no globalDefault class: priority 0
            spec.setdefault("priority", 0)
            spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        if self.default_toleration_seconds is not None:
            add_default_tolerations(spec, self.default_toleration_seconds)
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        for c in spec["containers"]:
            tagged = ":" in c["image"].rsplit("/", 1)[-1] and not c["image"].endswith(":latest")
            c.setdefault("imagePullPolicy", "IfNotPresent" if tagged else "Always")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now_timestamp())
        pod.update(apiVersion="v1", kind="Pod", status={"phase": "Pending"})
        if spec.get("schedulingGates"):  # the pod strategy's applySchedulingGatedCondition
            self._set_condition(
                pod,
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                },
            )
        with self._cond:
            if (ns, name) in self._pods:
                raise ApiError(409, "AlreadyExists", f'pods "{name}" already exists')
            if dry_run:
                return pod
            return self._record(ns, "ADDED", None, pod)

    def delete(
        self,
        ns: str,
        name: str,
        grace: int | None = None,
        preconditions: dict | None = None,
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Delete a pod: gracefully (deletionTimestamp, then the kubelet's part) if it runs on a
        node, else at once; ``dry_run``: the pod as the delete would answer, nothing changed."""
        with self._cond:
            pod = self._get(ns, name)
            for key, have in (
                ("uid", pod["metadata"]["uid"]),
                ("resourceVersion", pod["metadata"]["resourceVersion"]),
            ):
                if (preconditions or {}).get(key) not in (None, have):
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Precondition failed: {key} in "
                        f"precondition: {preconditions[key]}, {key} in object: {have}",
                    )
            if pod["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(pod)
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
            terminal = pod["status"].get("phase") in ("Succeeded", "Failed")
            if grace == 0 or terminal or not pod["spec"].get("nodeName"):
                return copy.deepcopy(pod) if dry_run else self._remove(ns, pod)
            new = copy.deepcopy(pod)
            new["metadata"].update(
                deletionTimestamp=now_timestamp(grace), deletionGracePeriodSeconds=grace
            )
            if dry_run:
                return new
            out = self._record(ns, "MODIFIED", pod, new)
            if self.kubelet:
                self.finish_deletion(name, ns=ns)
            return out

    def finish_deletion(self, name: str, exit_code: int = 143, ns: str | None = None) -> None:
        """The kubelet's part of a graceful delete: the container is killed (SIGTERM: 143),
        the pod turns Failed, then it is removed."""
        ns = ns or self.namespace
        with self._cond:
            if self._get(ns, name)["status"].get("phase") not in ("Succeeded", "Failed"):
                self.set_phase(name, "Failed", exit_code=exit_code, ns=ns)
            self._remove(ns, self._get(ns, name))

    def _remove(self, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
        new = copy.deepcopy(pod)
        if not new["metadata"].get("deletionTimestamp"):
            new["metadata"].update(deletionTimestamp=now_timestamp(), deletionGracePeriodSeconds=0)
        return self._record(ns, "DELETED", pod, new)

    def apply(
        self,
        ns: str,
        name: str,
        body: dict[str, Any],
        manager: str,
        *,
        force: bool = False,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Server-side apply of a pod (``api_apply.server_side_apply``, conflicts unless
        ``force``): created from ``body`` if there is none (with pod admission), else its fields
        merged in (the same checks of what a pod update may change); (the pod, whether
        created). ``dry_run``: nothing stored."""
        _check_applied(("Pod", "v1"), name, body)
        if self.validate_pods:
            check_applied("Pod", "v1", ns, name, body)
        with self._cond:
            live = self._pods.get((ns, name))
            new = server_side_apply(
                None if live is None else copy.deepcopy(live),
                body,
                manager,
                now_timestamp(),
                force,
            )
            if live is None:
                return self.create(ns, new, dry_run), True
            return self._update(ns, name, live, new, status_only=False, dry_run=dry_run), False

    def patch(
        self,
        ns: str,
        name: str,
        body: Any,
        patch_type: str,
        status_only: bool = False,
        *,
        manager: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """A JSON, merge or strategic merge patch of a pod (``api_wire.patched``) or, with
        ``status_only``, of its status subresource; ``manager``: the field manager whose
        ``Update`` entry owns what it changed; ``dry_run``: nothing stored."""
        with self._cond:
            old = self._get(ns, name)
            new = patched(old, body, patch_type)
            if self.validate_pods:
                strategic = patch_type == STRATEGIC_MERGE_PATCH
                new = check_patched("Pod", "v1", new, body, strategic)
            return self._update(ns, name, old, new, status_only, manager=manager, dry_run=dry_run)

    def _update(
        self,
        ns: str,
        name: str,
        old: dict[str, Any],
        new: dict[str, Any],
        status_only: bool,
        *,
        manager: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """(lock held) Store ``new`` for the pod ``old``: what a pod update may change; a dry
        run: the pod as it would be stored."""
        with self._cond:
            rv = (new.get("metadata") or {}).get("resourceVersion")
            if rv not in (None, old["metadata"]["resourceVersion"]):
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods "{name}": '
                    "the object has been modified; please apply your changes to the "
                    "latest version and try again",
                )
            if status_only:  # the status subresource changes status only, the main one the rest
                new = {**old, "status": new.get("status", {})}
            else:
                new["status"] = old["status"]
                _check_scheduling_gates(name, old["spec"], new["spec"])
                if _mutable_spec(new["spec"]) != _mutable_spec(old["spec"]):
                    raise ApiError(
                        422,
                        "Invalid",
                        f'Pod "{name}" is invalid: spec: Forbidden: '
                        "pod updates may not change fields other than image, "
                        "activeDeadlineSeconds, tolerations (additions)",
                    )
            for key in ("name", "namespace", "uid", "creationTimestamp"):
                new["metadata"][key] = old["metadata"][key]
            if manager is not None:
                subresource = "status" if status_only else ""
                new = update_managed_fields(old, new, manager, "v1", now_timestamp(), subresource)
            if new == old:  # nothing to write: the resourceVersion stays (kubectl: no change)
                return copy.deepcopy(old)
            if dry_run:
                new = copy.deepcopy(new)
                new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                return new
            return self._record(ns, "MODIFIED", old, new)

    def list(
        self,
        ns: str,
        labels: str = "",
        name: str | None = None,
        fields: FieldSelector | None = None,
    ) -> dict[str, Any]:
        """Pods of ``ns`` matching the label selector ``labels`` and the field selector
        ``fields`` (and called ``name``); ``ns`` "" is every namespace."""
        selector = parse_label_selector(labels)
        with self._cond:
            items = [
                copy.deepcopy(p)
                for (n, pod_name), p in sorted(self._pods.items())
                if ns in ("", n)
                and name in (None, pod_name)
                and labels_match(selector, p["metadata"].get("labels") or {})
                and fields_match(fields or [], p)
            ]
            rv = str(self._rv)
        for item in items:  # items of a typed list carry no kind/apiVersion
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    # -- test hooks ----------------------------------------------------------------------

    def pod(self, name: str, ns: str | None = None) -> dict[str, Any]:
        ns = ns or self.namespace
        with self._cond:
            return copy.deepcopy(self._get(ns, name))

    def set_phase(
        self,
        name: str,
        phase: str,
        reason: str | None = None,
        exit_code: int | None = None,
        conditions: list[dict] | None = None,
        message: str | None = None,
        container_reason: str | None = None,
        node: str = "fake-node-1",
        ns: str | None = None,
    ) -> dict[str, Any]:
        """Scheduler and kubelet: move a pod to ``phase``. ``reason``/``message`` are the
        pod-level status fields (e.g. Evicted); ``exit_code`` ends the worker container."""
        ns = ns or self.namespace
        with self._cond:
            old = self._get(ns, name)
            new = copy.deepcopy(old)
            status, spec = new["status"], new["spec"]
            status["phase"] = phase
            for key, value in (("reason", reason), ("message", message)):
                if value is not None:
                    status[key] = value
            if phase != "Pending" and not spec.get("nodeName"):
                spec["nodeName"] = node
                status.update(
                    hostIP="10.0.0.1", podIP=f"10.1.0.{next(self._ips)}", startTime=now_timestamp()
                )
            names = [c["name"] for c in spec["containers"]]
            if phase == "Running":
                state = {"running": {"startedAt": now_timestamp()}}
            elif phase == "Succeeded" or (phase == "Failed" and exit_code is not None):
                code = exit_code or 0
                state = {
                    "terminated": {
                        "exitCode": code,
                        "finishedAt": now_timestamp(),
                        "reason": container_reason or ("Completed" if code == 0 else "Error"),
                    }
                }
            else:
                state = None
            if state is not None and (phase != old["status"]["phase"] or exit_code is not None):
                status["containerStatuses"] = [
                    {
                        "name": n,
                        "state": state,
                        "ready": phase == "Running",
                        "restartCount": 0,
                        "image": c["image"],
                        "imageID": f"{c['image']}@sha256:{'0' * 64}",
                        "containerID": f"containerd://{uuid.uuid4().hex}",
                        "started": phase == "Running",
                    }
                    for n, c in zip(names, spec["containers"], strict=True)
                ]
            ready = "True" if phase == "Running" else "False"
            merged = {c["type"]: c for c in status.get("conditions") or []}
            if spec.get("nodeName"):
                merged["PodScheduled"] = {"type": "PodScheduled", "status": "True"}
            for kind in ("Ready", "ContainersReady"):
                merged[kind] = {"type": kind, "status": ready}
            for c in conditions or []:
                merged[c["type"]] = {"status": "True", "lastTransitionTime": now_timestamp(), **c}
            status["conditions"] = list(merged.values())
            return self._record(ns, "MODIFIED", old, new)

    def bind(self, ns: str, name: str, node: str) -> dict[str, Any]:
        """The scheduler's binding (pods/binding): ``spec.nodeName``, ``PodScheduled=True``."""
        with self._cond:
            old = self._get(ns, name)
            if old["spec"].get("nodeName"):
                raise ApiError(409, "Conflict", f"pod {name} is already assigned to a node")
            new = copy.deepcopy(old)
            new["spec"]["nodeName"] = node
            new["status"].pop("nominatedNodeName", None)
            self._set_condition(new, {"type": "PodScheduled", "status": "True"})
            return self._record(ns, "MODIFIED", old, new)

    def mark_unschedulable(
        self, ns: str, name: str, message: str, nominated_node: str | None = None
    ) -> dict[str, Any]:
        """The scheduler found no node: ``PodScheduled=False``, reason ``Unschedulable``;
        ``nominated_node``: where its preemption victims are terminating."""
        with self._cond:
            old = self._get(ns, name)
            new = copy.deepcopy(old)
            if nominated_node:
                new["status"]["nominatedNodeName"] = nominated_node
            else:
                new["status"].pop("nominatedNodeName", None)
            self._set_condition(
                new,
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                },
            )
            return self._record(ns, "MODIFIED", old, new)

    def update_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """The kubelet's status write: ``status`` merged into the pod's (conditions and
        containerStatuses by key, as a strategic merge patch does)."""
        with self._cond:
            old = self._get(ns, name)
            new = copy.deepcopy(old)
            new["status"] = merge_patch(old["status"], status, strategic=True)
            return self._record(ns, "MODIFIED", old, new)

    def remove_pod(self, ns: str, name: str) -> None:
        """The kubelet confirms a graceful deletion (or pod GC force-deletes): the pod is
        gone."""
        with self._cond:
            self._remove(ns, self._get(ns, name))

    @staticmethod
    def _set_condition(pod: dict[str, Any], condition: dict[str, Any]) -> None:
        conditions = pod["status"].setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != condition["type"]]
        conditions.append({**condition, "lastTransitionTime": now_timestamp()})

    def _disrupt(self, name: str, reason: str, message: str, ns: str) -> None:
        with self._cond:
            self.set_phase(
                name,
                self._get(ns, name)["status"]["phase"],
                ns=ns,
                conditions=[{"type": "DisruptionTarget", "reason": reason, "message": message}],
            )

    def preempt(
        self, name: str, ns: str | None = None, reason: str = "PreemptionByScheduler"
    ) -> None:
        """The scheduler preempts the pod (Kubernetes >= 1.26; the reason was
        PreemptionByKubeScheduler before 1.31): DisruptionTarget, then a graceful delete."""
        ns = ns or self.namespace
        self._disrupt(
            name, reason, "default-scheduler: preempting to accommodate a higher priority pod", ns
        )
        self.delete(ns, name)

    def evict(self, name: str, ns: str | None = None) -> None:
        """Node-pressure eviction by the kubelet: the pod stays, Failed with reason Evicted."""
        ns = ns or self.namespace
        self._disrupt(name, "TerminationByKubelet", "The node was low on resource: memory.", ns)
        self.set_phase(
            name,
            "Failed",
            reason="Evicted",
            exit_code=137,
            ns=ns,
            message="The node was low on resource: memory.",
        )

    def lose_node(self, name: str, ns: str | None = None) -> None:
        """The taint manager evicts the pod from a lost node (a NoExecute taint it tolerates no
        longer): ``DisruptionTarget`` (``DeletionByTaintManager``), then deleted. No kubelet
        confirms, so it is marked Failed and removed at once (in Kubernetes it stays
        Terminating until pod GC force-deletes it, once the Node object is gone)."""
        ns = ns or self.namespace
        self._disrupt(
            name, "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint", ns
        )
        with self._cond:
            self.set_phase(name, "Failed", ns=ns)
            self._remove(ns, self._get(ns, name))

    def compact(self) -> None:
        """Forget all history (as etcd compaction does) and end open watches; watchers that
        reconnect from a resourceVersion older than now get 410 Gone."""
        with self._cond:
            self._history.clear()
            self._object_history.clear()
            self._floor = self._object_floor = self._rv
        self.close_watches()

    def close_watches(self) -> None:
        """End every open watch stream cleanly, as the API server does at timeoutSeconds."""
        with self._cond:
            for stream in self._streams:
                stream.closed = True
            self._cond.notify_all()

    def hold_watches(self) -> None:
        """New watch requests wait until :meth:`release_watches` (open ones are unaffected)."""
        with self._cond:
            self._held = True

    def release_watches(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @property
    def open_watches(self) -> int:
        with self._cond:
            return len(self._streams)

    def stop(self) -> None:
        """Close every stream and connection, stop serving and join every thread."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
        self.close_watches()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()  # joins the handler threads
        self._thread.join()

    # -- watch ---------------------------------------------------------------------------

    def watch(
        self, handler: Handler, ns: str, query: dict[str, str], resource: str = "pods"
    ) -> None:
        """Stream the changes of ``resource`` (pods, or another stored kind) in ``ns`` ("":
        every namespace) as watch events, from ``query``'s resourceVersion."""
        pods = resource == "pods"
        kind, api_version = ("Pod", "v1") if pods else self._kind(resource)
        history = self._history if pods else self._object_history

        def floor() -> int:
            return self._floor if pods else self._object_floor

        selector = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), resource)
        rv = query.get("resourceVersion", "")
        now = time.monotonic()
        end = now + min(float(query.get("timeoutSeconds") or "inf"), self.watch_timeout_s)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        next_bookmark = now + self.bookmark_s if bookmarks else math.inf
        stream = _Stream()

        def visible(obj: dict | None) -> bool:
            return (
                obj is not None
                and obj.get("kind", kind) == kind
                and ns in ("", obj["metadata"].get("namespace", ""))
                and fields_match(fields, obj)
                and labels_match(selector, obj["metadata"].get("labels") or {})
            )

        with self._cond:
            while self._held and not self._stopping:
                self._cond.wait()
            if self._stopping:
                raise ApiError(503, "ServiceUnavailable", "apiserver is shutting down")
            initial = query.get("sendInitialEvents", "").lower() in ("true", "1")
            if rv in ("", "0") or initial:  # synthetic ADDED for the current state
                cursor = self._rv
                current = (
                    list(self._pods.values())
                    if pods
                    else [
                        self._with_status(resource, copy.deepcopy(obj))
                        for (r, _, _), obj in sorted(self._objects.items())
                        if r == resource
                    ]
                )
                backlog = [("ADDED", copy.deepcopy(o)) for o in current if visible(o)]
                if initial and bookmarks:  # a watch-list client: its initial list ends here
                    end_of_list = _bookmark(cursor, kind, api_version)
                    end_of_list["metadata"]["annotations"] = {"k8s.io/initial-events-end": "true"}
                    backlog.append(("BOOKMARK", end_of_list))
            elif not rv.isdigit():
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv!r}")
            else:
                cursor, backlog = int(rv), []
            self._expire_history()
            self._streams.add(stream)
        handler.start_stream()
        try:
            while True:
                for event_type, obj in backlog:
                    handler.write_chunk({"type": event_type, "object": obj})
                backlog = []
                with self._cond:
                    while True:
                        self._expire_history()
                        expired = cursor < floor()
                        t = time.monotonic()
                        cut = stream.closed or self._stopping  # no goodbye: dropped at once
                        timed_out = t >= end
                        if (
                            expired
                            or cut
                            or timed_out
                            or t >= next_bookmark
                            or (history and history[-1][0] > cursor)
                        ):
                            break
                        self._cond.wait(max(0.0, min(end, next_bookmark) - t))
                    floor_rv = floor()
                    for ev_rv, _, change, old, new, _ in [] if expired or cut else history:
                        if ev_rv <= cursor:
                            continue
                        cursor = ev_rv
                        was, now = visible(old), visible(new) and change != "DELETED"
                        if not pods and resource not in OBJECT_KINDS:  # the request's version
                            new = {**new, "apiVersion": api_version}
                        if now:
                            backlog.append(("MODIFIED" if was else "ADDED", new))
                        elif was:  # deleted, or changed so that it left the selection
                            backlog.append(("DELETED", new))
                    if bookmarks and not (expired or cut) and (timed_out or t >= next_bookmark):
                        # Every event up to the current resourceVersion is in the backlog, so
                        # resuming from it misses none; one comes just before a timeout too.
                        cursor = max(cursor, self._rv)
                        backlog.append(("BOOKMARK", _bookmark(cursor, kind, api_version)))
                        next_bookmark = t + self.bookmark_s
                if expired:  # what the real server sends: HTTP 200, then one ERROR event
                    status = ApiError(
                        410, "Expired", f"too old resource version: {cursor} ({floor_rv + 1})"
                    ).status
                    handler.write_chunk({"type": "ERROR", "object": status})
                    return
                if cut:
                    return
                if timed_out:
                    for event_type, obj in backlog:
                        handler.write_chunk({"type": event_type, "object": obj})
                    return
        finally:
            with self._cond:
                self._streams.discard(stream)
            handler.end_stream()


class _Stream:
    closed = False


def _bookmark(resource_version: int, kind: str = "Pod", api_version: str = "v1") -> dict[str, Any]:
    """A BOOKMARK event's object: only the kind and the resourceVersion to resume from."""
    return {
        "kind": kind,
        "apiVersion": api_version,
        "metadata": {"resourceVersion": str(resource_version)},
    }


def _check_applied(kind: tuple[str, str], name: str, body: dict[str, Any]) -> None:
    """What the API server checks of an apply patch against its URL: kind, apiVersion and
    name (400 where they do not match)."""
    meta = body.get("metadata") or {}
    if (body.get("kind"), body.get("apiVersion")) != kind:
        raise ApiError(
            400,
            "BadRequest",
            f"the apply patch is a {body.get('apiVersion')}, Kind={body.get('kind')}, not a "
            f"{kind[1]}, Kind={kind[0]}",
        )
    if meta.get("name") != name:
        raise ApiError(
            400,
            "BadRequest",
            f"the name of the object ({meta.get('name')}) does not match the name on the URL "
            f"({name})",
        )


def _check_unchanged(
    resource: str, kind_version: tuple[str, str], name: str, old: dict, new: dict
) -> None:
    """An update may not rename an object, nor change what its kind keeps immutable (a
    PriorityClass' value, a ReplicaSet's selector): 422 as the API server's validation says."""
    kind, api_version = kind_version
    group = api_version.rpartition("/")[0]
    qualified = f"{kind}.{group}" if group else kind
    problems = []
    if (new.get("metadata") or {}).get("name") != name:
        problems.append(f"metadata.name: Invalid value: {new['metadata'].get('name')!r}")
    if resource == "priorityclasses" and new.get("value") != old.get("value"):
        problems.append("value: Forbidden: may not be changed in an update.")
    if resource == "replicasets" and (new.get("spec") or {}).get("selector") != (
        old.get("spec") or {}
    ).get("selector"):
        problems.append("spec.selector: Invalid value: field is immutable")
    if problems:
        raise ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: ' + ", ".join(problems))


def _validate_object(resource: str, kind: str, name: str, obj: dict[str, Any]) -> None:
    """The API server's validation of the fields the fake acts on: 422 when it would refuse."""
    problems = []
    if resource in ("rolebindings", "clusterrolebindings"):
        for i, subject in enumerate(obj.get("subjects") or []):
            # In a RoleBinding a ServiceAccount's namespace defaults to the binding's.
            cluster_wide = resource == "clusterrolebindings"
            if (
                subject.get("kind") == "ServiceAccount"
                and cluster_wide
                and not subject.get("namespace")
            ):
                problems.append(f"subjects[{i}].namespace: Required value")
        if (obj.get("roleRef") or {}).get("kind") not in ("Role", "ClusterRole"):
            problems.append("roleRef.kind: Unsupported value")
    if resource == "poddisruptionbudgets":
        spec = obj.get("spec") or {}
        if "minAvailable" in spec and "maxUnavailable" in spec:
            problems.append(
                "spec: Invalid value: minAvailable and maxUnavailable cannot be both set"
            )
        for key in ("minAvailable", "maxUnavailable"):
            value = spec.get(key)
            if isinstance(value, str) and not re.fullmatch(r"\d+%", value):
                problems.append(
                    f"spec.{key}: Invalid value: {value!r}: must be an int or a percent"
                )
    if problems:
        raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: ' + ", ".join(problems))


def add_default_tolerations(spec: dict[str, Any], seconds: int) -> None:
    """The DefaultTolerationSeconds admission plugin: a pod with no toleration of its own for
    the not-ready or the unreachable NoExecute taint gets one for ``seconds`` (the plugin's
    test: the taint's key or an empty key, effect NoExecute or empty)."""
    tolerations = spec.get("tolerations") or []
    for key in NODE_LOSS_TAINTS:
        if any(
            t.get("key", "") in (key, "") and t.get("effect", "") in ("NoExecute", "")
            for t in tolerations
        ):
            continue
        tolerations.append(
            {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
        )
    if tolerations:
        spec["tolerations"] = tolerations


def _check_scheduling_gates(name: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Scheduling gates may only be removed after a pod's creation, never added (422)."""
    had = {gate.get("name") for gate in old.get("schedulingGates") or []}
    added = [g.get("name") for g in new.get("schedulingGates") or [] if g.get("name") not in had]
    if added:
        raise ApiError(
            422,
            "Invalid",
            f'Pod "{name}" is invalid: spec.schedulingGates: Forbidden: only deletion is '
            f"allowed, but found new scheduling gate '{added[0]}'",
        )


def _mutable_spec(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for key in ("activeDeadlineSeconds", "tolerations", "schedulingGates"):
        spec.pop(key, None)
    for c in spec.get("containers", []):
        c.pop("image", None)
    return spec


def _check_namespace(meta: dict[str, Any], ns: str) -> None:
    """An object's own namespace, where it names one, is the request's (else 400, as
    kube-apiserver refuses it)."""
    if meta.get("namespace", ns) != ns:
        raise ApiError(
            400,
            "BadRequest",
            "the namespace of the provided object does not match the namespace sent on the request",
        )
