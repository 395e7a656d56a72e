"""A fake Kubernetes API server for pods, speaking real HTTP on 127.0.0.1.

The real ``kubernetes`` client runs against it unchanged. It keeps what a controller depends
on: a monotonic resourceVersion on every object, list and event; create/get/list/delete/patch
with the real Status errors (404 NotFound, 409 AlreadyExists/Conflict, 422 Invalid, 403 from
the Priority and ServiceAccount admission plugins); label selectors; graceful deletion of
scheduled pods (deletionTimestamp, then the kubelet's terminal status, then DELETED); and
watches that stream JSON lines from any retained resourceVersion, or one ERROR event with a 410
Status when asked for compacted history. Test hooks play scheduler, kubelet and node lifecycle.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections import deque
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PRIORITY_CLASSES = {"kfp-elastic-worker-low": (-5, "Never"),
                    "kfp-elastic-control": (100000, "PreemptLowerPriority"),
                    "system-cluster-critical": (2000000000, "PreemptLowerPriority")}  # fmt: skip
SERVICE_ACCOUNTS = {"default", "kfp-elastic-worker", "kfp-elastic-master"}
_PATH = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?P<sub>/status)?)?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_REQUIREMENT = re.compile(r"\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9./_-]+)\s*(?:(?P<op>==|=|!=)\s*"
                          r"(?P<val>[A-Za-z0-9._-]*)|\s+(?P<set>in|notin)\s*\((?P<vals>[^)]*)\))?\s*")
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "conditions": "type", "containerStatuses": "name", "ownerReferences": "uid"}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "code": code}  # fmt: skip


def _now(delta: float = 0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_label_selector(text: str) -> list[tuple[str, str, set[str]]]:
    parts = re.findall(r"(?:[^,(]|\([^)]*\))+", text or "")
    out = []
    for part in parts:
        m = _REQUIREMENT.fullmatch(part)
        if not m or (m["neg"] and (m["op"] or m["set"])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        if m["set"]:
            out.append((m["key"], m["set"], {v.strip() for v in m["vals"].split(",")}))
        else:
            op = "!" if m["neg"] else {"==": "="}.get(m["op"], m["op"] or "exists")
            out.append((m["key"], op, {m["val"] or ""}))
    return out


def _labels_match(selector: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in selector:
        value = labels.get(key)
        ok = {"=": value in values, "in": value in values, "!=": value not in values,
              "notin": value not in values, "exists": key in labels, "!": key not in labels}[op]
        if not ok:
            return False
    return True


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; ``strategic`` merges the lists Kubernetes merges by key instead of
    replacing them (``$patch`` directives are not supported)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif strategic and key in _MERGE_KEYS and isinstance(value, list):
            merged = {item.get(_MERGE_KEYS[key]): item for item in out.get(key) or []}
            for item in value:
                k = item.get(_MERGE_KEYS[key])
                merged[k] = merge_patch(merged.get(k, {}), item, True)
            out[key] = list(merged.values())
        else:
            out[key] = merge_patch(out.get(key), value, strategic)
    return out


class FakeKubernetes:
    """``with FakeKubernetes() as k8s:`` serves at ``k8s.url`` until the block ends."""

    def __init__(self, *, history: int = 1000, priority_classes: dict | None = None,
                 service_accounts: set[str] | None = None, kubelet: bool = True,
                 namespace: str = "default") -> None:
        self._cond = threading.Condition()
        self._rv = 100
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: deque[tuple[int, str, str, dict | None, dict]] = deque()
        self._max_history = history
        self._floor = self._rv  # watches from a resourceVersion below this get 410
        self._streams: set[_Stream] = set()
        self._held = self._stopping = False
        self._ips = itertools.count(10)
        self.priority_classes = PRIORITY_CLASSES if priority_classes is None else priority_classes
        self.service_accounts = SERVICE_ACCOUNTS if service_accounts is None else service_accounts
        self.namespace = namespace  # what the test hooks act on by default
        self.kubelet = kubelet  # False: deleted scheduled pods stay Terminating until finished
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-k8s",
                                        kwargs={"poll_interval": 0.05})  # fmt: skip
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
        self._history.append((self._rv, ns, kind, copy.deepcopy(old), copy.deepcopy(new)))
        while len(self._history) > self._max_history:
            self._floor = self._history.popleft()[0]
        self._cond.notify_all()
        return copy.deepcopy(new)

    def _get(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self._pods:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        return self._pods[(ns, name)]

    def create(self, ns: str, pod: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        meta, spec = pod.setdefault("metadata", {}), pod.setdefault("spec", {})
        if meta.get("namespace", ns) != ns:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not "
                           "match the namespace sent on the request")  # fmt: skip
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name", "")
        problems = []
        if not name or len(name) > 253 or not _NAME.fullmatch(name):
            problems.append(f"metadata.name: Invalid value: {name!r}")
        if not spec.get("containers"):
            problems.append("spec.containers: Required value")
        for i, c in enumerate(spec.get("containers") or []):
            problems += [f"spec.containers[{i}].{k}: Required value" for k in ("name", "image")
                         if not c.get(k)]  # fmt: skip
        if spec.get("restartPolicy", "Always") not in ("Always", "OnFailure", "Never"):
            problems.append("spec.restartPolicy: Unsupported value")
        if problems:
            raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: ' + ", ".join(problems))
        pc = spec.get("priorityClassName")
        if pc is not None and pc not in self.priority_classes:
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: no PriorityClass '
                           f"with name {pc} was found")  # fmt: skip
        sa = spec.setdefault("serviceAccountName", "default")
        if sa not in self.service_accounts:
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: error looking up '
                           f'service account {ns}/{sa}: serviceaccount "{sa}" not found')
        spec["serviceAccount"] = sa
        if pc is not None:
            spec["priority"], spec["preemptionPolicy"] = self.priority_classes[pc]
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        for c in spec["containers"]:
            tagged = ":" in c["image"].rsplit("/", 1)[-1] and not c["image"].endswith(":latest")
            c.setdefault("imagePullPolicy", "IfNotPresent" if tagged else "Always")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        pod.update(apiVersion="v1", kind="Pod", status={"phase": "Pending"})
        with self._cond:
            if (ns, name) in self._pods:
                raise ApiError(409, "AlreadyExists", f'pods "{name}" already exists')
            if dry_run:
                return pod
            return self._record(ns, "ADDED", None, pod)

    def delete(self, ns: str, name: str, grace: int | None = None,
               preconditions: dict | None = None) -> dict[str, Any]:  # fmt: skip
        with self._cond:
            pod = self._get(ns, name)
            for key, have in (("uid", pod["metadata"]["uid"]),
                              ("resourceVersion", pod["metadata"]["resourceVersion"])):
                if (preconditions or {}).get(key) not in (None, have):
                    raise ApiError(409, "Conflict", f"Precondition failed: {key} in "
                                   f"precondition: {preconditions[key]}, {key} in object: {have}")
            if pod["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(pod)
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
            terminal = pod["status"].get("phase") in ("Succeeded", "Failed")
            if grace == 0 or terminal or not pod["spec"].get("nodeName"):
                return self._remove(ns, pod)
            new = copy.deepcopy(pod)
            new["metadata"].update(deletionTimestamp=_now(grace), deletionGracePeriodSeconds=grace)
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
            new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        return self._record(ns, "DELETED", pod, new)

    def patch(self, ns: str, name: str, body: Any, content_type: str,
              status_only: bool = False) -> dict[str, Any]:  # fmt: skip
        with self._cond:
            old = self._get(ns, name)
            if "merge-patch" not in content_type or not isinstance(body, dict):
                # JSON patch (a list body) and server-side apply are not implemented
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch: {content_type}")
            new = merge_patch(old, body, strategic="strategic" in content_type)
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv not in (None, old["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods "{name}": '
                               "the object has been modified; please apply your changes to the "
                               "latest version and try again")  # fmt: skip
            if status_only:  # the status subresource changes status only, the main one the rest
                new = {**old, "status": new.get("status", {})}
            else:
                new["status"] = old["status"]
                if _mutable_spec(new["spec"]) != _mutable_spec(old["spec"]):
                    raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: spec: Forbidden: '
                                   "pod updates may not change fields other than image, "
                                   "activeDeadlineSeconds, tolerations (additions)")  # fmt: skip
            for key in ("name", "namespace", "uid", "creationTimestamp"):
                new["metadata"][key] = old["metadata"][key]
            return self._record(ns, "MODIFIED", old, new)

    def list(self, ns: str, labels: str = "") -> dict[str, Any]:
        selector = parse_label_selector(labels)
        with self._cond:
            items = [copy.deepcopy(p) for (n, _), p in sorted(self._pods.items()) if n == ns
                     and _labels_match(selector, p["metadata"].get("labels") or {})]
            rv = str(self._rv)
        for item in items:  # items of a typed list carry no kind/apiVersion
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv},
                "items": items}  # fmt: skip

    # -- test hooks ----------------------------------------------------------------------

    def pod(self, name: str, ns: str | None = None) -> dict[str, Any]:
        ns = ns or self.namespace
        with self._cond:
            return copy.deepcopy(self._get(ns, name))

    def set_phase(self, name: str, phase: str, reason: str | None = None,
                  exit_code: int | None = None, conditions: list[dict] | None = None,
                  message: str | None = None, container_reason: str | None = None,
                  node: str = "fake-node-1", ns: str | None = None) -> dict[str, Any]:  # fmt: skip
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
                status.update(hostIP="10.0.0.1", podIP=f"10.1.0.{next(self._ips)}",
                              startTime=_now())  # fmt: skip
            names = [c["name"] for c in spec["containers"]]
            if phase == "Running":
                state = {"running": {"startedAt": _now()}}
            elif phase == "Succeeded" or (phase == "Failed" and exit_code is not None):
                code = exit_code or 0
                state = {"terminated": {"exitCode": code, "finishedAt": _now(),
                                        "reason": container_reason or ("Completed" if code == 0
                                                                       else "Error")}}  # fmt: skip
            else:
                state = None
            if state is not None and (phase != old["status"]["phase"] or exit_code is not None):
                status["containerStatuses"] = [
                    {"name": n, "state": state, "ready": phase == "Running", "restartCount": 0,
                     "image": c["image"], "imageID": f"{c['image']}@sha256:{'0' * 64}",
                     "containerID": f"containerd://{uuid.uuid4().hex}",
                     "started": phase == "Running"}
                    for n, c in zip(names, spec["containers"], strict=True)]  # fmt: skip
            ready = "True" if phase == "Running" else "False"
            merged = {c["type"]: c for c in status.get("conditions") or []}
            if spec.get("nodeName"):
                merged["PodScheduled"] = {"type": "PodScheduled", "status": "True"}
            for kind in ("Ready", "ContainersReady"):
                merged[kind] = {"type": kind, "status": ready}
            for c in conditions or []:
                merged[c["type"]] = {"status": "True", "lastTransitionTime": _now(), **c}
            status["conditions"] = list(merged.values())
            return self._record(ns, "MODIFIED", old, new)

    def _disrupt(self, name: str, reason: str, message: str, ns: str) -> None:
        with self._cond:
            self.set_phase(name, self._get(ns, name)["status"]["phase"], ns=ns,
                           conditions=[{"type": "DisruptionTarget", "reason": reason,
                                        "message": message}])  # fmt: skip

    def preempt(self, name: str, ns: str | None = None,
                reason: str = "PreemptionByScheduler") -> None:  # fmt: skip
        """The scheduler preempts the pod (Kubernetes >= 1.26; the reason was
        PreemptionByKubeScheduler before 1.31): DisruptionTarget, then a graceful delete."""
        ns = ns or self.namespace
        self._disrupt(name, reason, "default-scheduler: preempting to accommodate a higher "
                      "priority pod", ns)  # fmt: skip
        self.delete(ns, name)

    def evict(self, name: str, ns: str | None = None) -> None:
        """Node-pressure eviction by the kubelet: the pod stays, Failed with reason Evicted."""
        ns = ns or self.namespace
        self._disrupt(name, "TerminationByKubelet", "The node was low on resource: memory.", ns)
        self.set_phase(name, "Failed", reason="Evicted", exit_code=137, ns=ns,
                       message="The node was low on resource: memory.")  # fmt: skip

    def lose_node(self, name: str, ns: str | None = None) -> None:
        """The node stops responding: the taint manager deletes the pod; no kubelet confirms,
        so pod GC marks it Failed and force-deletes it."""
        ns = ns or self.namespace
        self._disrupt(name, "DeletionByTaintManager", "Taint manager: deleting due to NoExecute "
                      "taint", ns)  # fmt: skip
        with self._cond:
            self.set_phase(name, "Failed", ns=ns)
            self._remove(ns, self._get(ns, name))

    def compact(self) -> None:
        """Forget all history (as etcd compaction does) and end open watches; watchers that
        reconnect from a resourceVersion older than now get 410 Gone."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv
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

    def watch(self, handler: _Handler, ns: str, query: dict[str, str]) -> None:
        selector = parse_label_selector(query.get("labelSelector", ""))
        rv = query.get("resourceVersion", "")
        end = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        stream = _Stream()

        def visible(pod: dict | None) -> bool:
            return pod is not None and pod["metadata"]["namespace"] == ns and _labels_match(
                selector, pod["metadata"].get("labels") or {})

        with self._cond:
            while self._held and not self._stopping:
                self._cond.wait()
            if self._stopping:
                raise ApiError(503, "ServiceUnavailable", "apiserver is shutting down")
            if rv in ("", "0"):  # "start at most recent": synthetic ADDED for current state
                cursor = self._rv
                backlog = [("ADDED", copy.deepcopy(p)) for p in self._pods.values() if visible(p)]
            elif not rv.isdigit():
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv!r}")
            else:
                cursor, backlog = int(rv), []
            self._streams.add(stream)
        handler.start_stream()
        try:
            while True:
                for kind, obj in backlog:
                    handler.write_chunk({"type": kind, "object": obj})
                backlog = []
                with self._cond:
                    while True:
                        expired = cursor < self._floor
                        ended = stream.closed or self._stopping or time.monotonic() >= end
                        if expired or ended or (self._history and self._history[-1][0] > cursor):
                            break
                        self._cond.wait(max(0.0, end - time.monotonic()))
                    floor = self._floor
                    for ev_rv, _, kind, old, new in [] if expired or ended else self._history:
                        if ev_rv <= cursor:
                            continue
                        cursor = ev_rv
                        was, now = visible(old), visible(new) and kind != "DELETED"
                        if now:
                            backlog.append(("MODIFIED" if was else "ADDED", new))
                        elif was:  # deleted, or changed so that it left the selection
                            backlog.append(("DELETED", new))
                if expired:  # what the real server sends: HTTP 200, then one ERROR event
                    status = ApiError(410, "Expired", f"too old resource version: {cursor} "
                                      f"({floor + 1})").status  # fmt: skip
                    handler.write_chunk({"type": "ERROR", "object": status})
                    return
                if ended:
                    return
        finally:
            with self._cond:
                self._streams.discard(stream)
            handler.end_stream()


class _Stream:
    closed = False


def _mutable_spec(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for key in ("activeDeadlineSeconds", "tolerations"):
        spec.pop(key, None)
    for c in spec.get("containers", []):
        c.pop("image", None)
    return spec


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins every handler thread
    fake: FakeKubernetes

    def __init__(self, *args: Any) -> None:
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up is no error
            super().handle_error(request, client_address)

    def close_connections(self) -> None:
        """Unblock handler threads waiting on idle keep-alive connections."""
        with self._conns_lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate small writes
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def write_chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _dispatch(self, method: str) -> None:
        fake = self.server.fake
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        fake.requests.append((method, url.path, query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            m = _PATH.fullmatch(url.path)
            if not m:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            ns, name, sub = m["ns"], m["name"], m["sub"]
            if query.get("fieldSelector"):
                raise ApiError(400, "BadRequest", "fieldSelector is not implemented by the fake")
            body = json.loads(raw) if raw else None
            if method == "GET" and name is None and query.get("watch", "").lower() in ("true", "1"):
                try:
                    return fake.watch(self, ns, query)
                except OSError:  # the client went away mid-stream
                    self.close_connection = True
                    return
            if method == "GET" and name is None:
                return self._send(200, fake.list(ns, query.get("labelSelector", "")))
            if method == "POST" and name is None:
                dry = query.get("dryRun") == "All"
                return self._send(200 if dry else 201, fake.create(ns, body or {}, dry))
            if method == "GET" and name:
                return self._send(200, fake.pod(name, ns))
            if method == "DELETE" and name and not sub:
                opts = body or {}
                grace = query.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
                return self._send(200, fake.delete(ns, name, None if grace is None else int(grace),
                                                   opts.get("preconditions")))  # fmt: skip
            if method == "PATCH" and name:
                ctype = self.headers.get("Content-Type", "")
                return self._send(200, fake.patch(ns, name, body, ctype, status_only=bool(sub)))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {url.path}")
        except ApiError as exc:
            self._send(exc.status["code"], exc.status)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._send(400, ApiError(400, "BadRequest", f"bad request: {exc}").status)

    def _handle(self) -> None:
        self._dispatch(self.command)

    do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _handle  # http.server's naming
