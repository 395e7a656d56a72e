"""Workers as Kubernetes pods, through the official ``kubernetes`` client (CoreV1Api).

The watch follows client-go's informer pattern: list, then watch from the list's
resourceVersion; on stream end reconnect from the last resourceVersion seen; on 410 Gone
(history compacted) list again and diff against what was already reported, so a worker that
changed or vanished while the watch was down still gets its event. An RBAC 403 on any call is
not retried: ``LauncherForbidden`` says which verb to grant, and the master fails the job.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kfp_elastic.master.launcher import (
    DISRUPTIONS,
    Launcher,
    LauncherForbidden,
    Reason,
    WorkerEvent,
    WorkerHandle,
    WorkerPhase,
)
from kfp_elastic.master.launcher import WorkerStatus as Status
from kfp_elastic.master.pod_spec import WorkerPodSpec, build_pod
from kfp_elastic.master.pod_spec import selector as job_selector
from kfp_elastic.master.pod_status import classify

log = logging.getLogger(__name__)

_REMEMBERED_DELETES = 10_000
# Where the master's Role comes from, for the message of a refused call.
ROLE_SOURCE = "manifests/base/rbac.yaml, Role kfp-elastic-master"
# RBAC's 403 (not an admission plugin's, which is also 403 Forbidden): who may not do what.
_RBAC_DENIAL = re.compile(
    r'is forbidden: User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]*)"'
    r' in API group "(?P<group>[^"]*)"'
)


class LaunchError(RuntimeError):
    """The API server refused to create a worker pod."""


def _key(status: Status) -> tuple[Any, ...]:
    return status.phase, status.reason, status.exit_code


class KubernetesLauncher(Launcher):
    """Worker pods of one job in one namespace.

    ``template``: the pod spec of every worker; ``worker_index`` and ``attempt`` are filled in
    per launch. ``api_client``: a configured ``kubernetes.client.ApiClient`` (from
    ``config.load_incluster_config()`` in a pod); it stays the caller's to close.
    ``watch_timeout_s``: the server ends each watch after this long and the launcher
    reconnects, which also bounds how long a silently dead connection goes unnoticed.
    """

    def __init__(
        self,
        template: WorkerPodSpec,
        namespace: str,
        api_client: client.ApiClient,
        *,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        max_backoff_s: float = 5.0,
        max_name_attempts: int = 20,
        first_attempts: Mapping[int, int] | None = None,
    ) -> None:
        """``first_attempts``: per worker index, the first attempt to name a pod after (a new
        master passes ``next_attempts`` of its workers table)."""
        if template.namespace not in (None, namespace):
            raise ValueError(f"template namespace {template.namespace!r} != {namespace!r}")
        build_pod(template)  # fail at construction, not at the first launch
        self.template = template
        self.namespace = namespace
        self.selector = job_selector(template.job_name, template.effective_run_id)
        self._core = client.CoreV1Api(api_client)
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        # (connect, read): the kubernetes client honours a pair or an int, and silently no
        # timeout at all for a float
        self._request_timeout = (request_timeout_s, request_timeout_s)
        self._max_backoff_s = max_backoff_s
        self._max_name_attempts = max_name_attempts
        self._lock = threading.Lock()
        self._next_attempt: dict[int, int] = dict(first_attempts or {})
        # Names this launcher deleted. Never reused (attempts), so only bounded, not pruned by
        # events: several consumers of events() may all need to recognise them.
        self._deleted: OrderedDict[str, None] = OrderedDict()
        # Counters for tests and metrics: how often the watch listed and (re)connected.
        self.list_count = 0
        self.watch_count = 0

    # -- launch / delete / list -------------------------------------------------------------

    def launch(self, worker_index: int) -> WorkerHandle:
        with self._lock:
            attempt = self._next_attempt.get(worker_index, 0)
            self._next_attempt[worker_index] = attempt + 1
        for _ in range(self._max_name_attempts):
            with self._lock:
                template = self.template
            spec = replace(
                template, worker_index=worker_index, attempt=attempt, namespace=self.namespace
            )
            try:
                self._core.create_namespaced_pod(
                    self.namespace,
                    build_pod(spec),
                    _preload_content=False,
                    _request_timeout=self._request_timeout,
                )
            except ApiException as exc:
                _raise_if_forbidden(exc, self.namespace)
                if exc.status == 409 and _status_reason(exc) == "AlreadyExists":
                    # A previous master (or a racing launch) used this attempt: take the next.
                    with self._lock:
                        attempt = max(attempt + 1, self._next_attempt[worker_index])
                        self._next_attempt[worker_index] = attempt + 1
                    continue
                raise LaunchError(
                    f"creating {spec.pod_name}: {exc.status} {_status_message(exc)}"
                ) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise LaunchError(
                    f"creating {spec.pod_name}: no answer from the API server "
                    f"({exc}); the pod may or may not exist"
                ) from exc
            return WorkerHandle(spec.pod_name, worker_index, attempt)
        raise LaunchError(f"worker {worker_index}: {self._max_name_attempts} names taken")

    def set_guaranteed_priority_class(self, name: str) -> None:
        with self._lock:
            self.template = replace(self.template, guaranteed_priority_class=name)

    def delete(self, name: str, grace_period_s: int | None = None) -> None:
        with self._lock:
            self._deleted[name] = None
            while len(self._deleted) > _REMEMBERED_DELETES:
                self._deleted.popitem(last=False)
        try:
            self._core.delete_namespaced_pod(
                name,
                self.namespace,
                grace_period_seconds=grace_period_s,
                propagation_policy="Background",
                _preload_content=False,
                _request_timeout=self._request_timeout,
            )
        except ApiException as exc:
            _raise_if_forbidden(exc, self.namespace)
            if exc.status != 404:  # already gone is what we wanted
                raise

    def list_workers(self) -> list[Status]:
        items, _ = self._list()
        return [self._classify(pod) for pod in items]

    def _list(self) -> tuple[list[dict[str, Any]], str]:
        try:
            resp = self._core.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                _preload_content=False,
                _request_timeout=self._request_timeout,
            )
        except ApiException as exc:
            _raise_if_forbidden(exc, self.namespace)
            raise
        body = json.loads(resp.data)
        self.list_count += 1
        return body.get("items") or [], body["metadata"]["resourceVersion"]

    def _classify(
        self, pod: Mapping[str, Any], deleted: bool = False, previous: Status | None = None
    ) -> Status:
        with self._lock:
            ours = pod.get("metadata", {}).get("name", "") in self._deleted
        return classify(pod, deleted=deleted, deleted_by_us=ours, previous=previous)

    # -- watch -------------------------------------------------------------------------------

    def events(self, stop: threading.Event) -> Iterator[WorkerEvent]:
        known: dict[str, Status] = {}
        resource_version: str | None = None
        backoff = 0.0
        guard = _StopGuard(stop)
        try:
            while not stop.is_set():
                try:
                    if resource_version is None:
                        items, resource_version = self._list()
                        yield from self._resync(known, items)
                    for event in self._watch_once(resource_version, guard):
                        kind, pod = event["type"], event["raw_object"]
                        resource_version = pod["metadata"]["resourceVersion"]
                        if kind == "BOOKMARK":
                            continue
                        yield from self._emit(known, pod, deleted=kind == "DELETED")
                        if stop.is_set():
                            return
                    backoff = 0.0
                except ApiException as exc:
                    _raise_if_forbidden(exc, self.namespace)
                    if exc.status == 410:  # history compacted: start over from a fresh list
                        log.info("watch expired (410 Gone): listing pods again")
                        resource_version, backoff = None, 0.0
                        continue
                    log.warning("pod watch failed: %s %s", exc.status, exc.reason)
                    backoff = min(max(backoff * 2, 0.2), self._max_backoff_s)
                except (urllib3.exceptions.HTTPError, OSError) as exc:
                    if stop.is_set():
                        return
                    log.warning("pod watch connection lost: %s", exc)
                    backoff = min(max(backoff * 2, 0.2), self._max_backoff_s)
                if backoff and stop.wait(backoff):
                    return
        finally:
            guard.close()

    def _watch_once(self, resource_version: str, guard: _StopGuard) -> Iterator[dict[str, Any]]:
        def call(**kwargs: Any) -> Any:  # keeps the response so that `stop` can interrupt it
            return guard.track(self._core.list_namespaced_pod(**kwargs))

        # return_type "object": events stay JSON dicts, as the list's items are.
        # timeout_seconds also turns off Watch.stream's own retries, so that reconnecting and
        # handling 410 happen here, with the bookkeeping above.
        self.watch_count += 1
        stream = watch.Watch(return_type="object").stream(
            call,
            namespace=self.namespace,
            label_selector=self.selector,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s,
            _request_timeout=(self._request_timeout_s, self._watch_timeout_s + 30),
        )
        try:
            yield from stream
        finally:
            stream.close()

    def _resync(
        self, known: dict[str, Status], items: list[dict[str, Any]]
    ) -> Iterator[WorkerEvent]:
        listed = {item["metadata"]["name"] for item in items}
        for item in items:
            yield from self._emit(known, item, deleted=False)
        for name in sorted(set(known) - listed):  # vanished while the watch was down
            previous = known[name]
            if previous.reason in DISRUPTIONS or previous.ended:
                reason = previous.reason
            else:
                with self._lock:
                    reason = Reason.DELETED if name in self._deleted else Reason.DELETED_EXTERNALLY
            del known[name]
            yield WorkerEvent(
                **{**_fields(previous), "phase": WorkerPhase.DELETED, "reason": reason}
            )

    def _emit(
        self, known: dict[str, Status], pod: Mapping[str, Any], deleted: bool
    ) -> Iterator[WorkerEvent]:
        name = pod["metadata"]["name"]
        previous = known.get(name)
        status = self._classify(pod, deleted=deleted, previous=previous)
        if deleted:
            known.pop(name, None)
        else:
            known[name] = status
        if previous is None or _key(previous) != _key(status):
            yield WorkerEvent(**_fields(status))


def _fields(status: Status) -> dict[str, Any]:
    return {name: getattr(status, name) for name in Status.__dataclass_fields__}


def _status_body(exc: ApiException) -> dict[str, Any]:
    try:
        body = exc.body.decode() if isinstance(exc.body, bytes) else exc.body
        return json.loads(body or "{}")
    except (ValueError, AttributeError):
        return {}


def forbidden_message(denial: str, namespace: str) -> str | None:
    """What to tell the operator when RBAC refused the master a call (``denial``: the API
    server's 403 message): which verb on which resource, and what to grant. None when the 403
    is not RBAC's (an admission plugin refusing a pod says so itself)."""
    m = _RBAC_DENIAL.search(denial)
    if not m:
        return None
    verb, resource, group = m["verb"], m["resource"], m["group"]
    in_group = f" in API group '{group}'" if group else ""
    return (
        f"the master's service account ({m['user']}) may not {verb} {resource} in namespace "
        f"{namespace}: grant verb '{verb}' on '{resource}'{in_group} in its Role "
        f"({ROLE_SOURCE}); the API server said: {denial}"
    )


def _raise_if_forbidden(exc: ApiException, namespace: str) -> None:
    if exc.status == 403:
        message = forbidden_message(_status_message(exc), namespace)
        if message is not None:
            log.error("kubernetes api call forbidden namespace=%s message=%s", namespace, message)
            raise LauncherForbidden(message) from exc


def _status_reason(exc: ApiException) -> str:
    return str(_status_body(exc).get("reason", ""))


def _status_message(exc: ApiException) -> str:
    return str(_status_body(exc).get("message", exc.reason))


class _StopGuard:
    """Interrupts a blocked watch read when ``stop`` is set, so stopping takes well under a
    second instead of up to ``watch_timeout_s``. A small helper thread polls ``stop``: a
    threading.Event offers no callback on set()."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name="k8s-watch-stop", daemon=True)
        self._thread.start()

    def track(self, response: Any) -> Any:
        with self._lock:
            self._response = response
        if self._stop.is_set():
            self._interrupt()
        return _Tracked(response, self)

    def untrack(self, response: Any) -> None:
        # Before the connection goes back to the pool: a shutdown after that could hit a
        # request of another thread that reuses the socket.
        with self._lock:
            if self._response is response:
                self._response = None

    def _run(self) -> None:
        while not self._done.wait(0.1):
            if self._stop.is_set():
                self._interrupt()
                return

    def _interrupt(self) -> None:
        with self._lock:
            if self._response is None:
                return
            try:
                self._response.shutdown()  # urllib3 >= 2.3: unblocks a read in another thread
            except AttributeError:  # older urllib3: shut the socket down directly
                sock = getattr(getattr(self._response, "_connection", None), "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            except OSError:
                pass

    def close(self) -> None:
        self._done.set()
        self._thread.join()


class _Tracked:
    """A watch response that tells the guard when it is closed or released."""

    def __init__(self, response: Any, guard: _StopGuard) -> None:
        self._response = response
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)

    def close(self) -> None:
        self._guard.untrack(self._response)
        self._response.close()

    def release_conn(self) -> None:
        self._guard.untrack(self._response)
        self._response.release_conn()
