"""The master's Kubernetes Events: recorded from its timeline, as client-go records a controller's.

:class:`EventRecorder` is the edge. The master hands it each event it puts on its timeline
(``MasterState.add_listener``); :func:`master.pod_events.pod_event` says which becomes which
core/v1 Event, and a daemon thread writes them, so recording never waits on the API server:
``record`` only queues (a full queue drops, as client-go's broadcaster drops). A write that
fails (a Role without ``events``, a timeout, an API server away) is logged once as a warning
per kind of failure and dropped; nothing of it reaches the job.

:class:`Correlator` is client-go's ``EventCorrelator`` (``tools/record/events_cache.go``),
without I/O: the same Event again (same object, type, reason and message) is not a new Event
but the first one's ``count`` and ``lastTimestamp`` patched; more than 10 Events that differ
only in their message within 10 minutes become one ``(combined from similar events)`` Event;
and each object gets a burst of 25 Events, then one per 5 minutes (a token bucket).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_elastic.master.k8s_launcher import ROLE_SOURCE
from kfp_elastic.master.pod_events import COMPONENT, PodEvent, Seen, clip, pod_event
from kfp_elastic.master.timeline import Event

log = logging.getLogger(__name__)

# client-go's defaults (tools/record/events_cache.go)
CACHE_ENTRIES = 4096
SPAM_BURST = 25
SPAM_REFILL_S = 300.0
AGGREGATE_AFTER = 10
AGGREGATE_WINDOW_S = 600.0
COMBINED = "(combined from similar events): "
MAX_QUEUED = 1000  # client-go's maxQueuedEvents
REQUEST_TIMEOUT_S = (3.0, 5.0)  # connect, read: a slow API server costs the recorder only
FLUSH_S = 3.0  # how long close() waits for the queued Events (the job's end among them)


@dataclass(frozen=True)
class Correlated:
    """What to write: ``body``, a new Event, or (``patch`` set) the Event named in ``body``
    seen again, to patch with ``patch``."""

    body: dict[str, Any]
    patch: dict[str, Any] | None = None


class _Lru(OrderedDict[str, Any]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_fresh(self, key: str) -> Any:
        if key in self:
            self.move_to_end(key)
        return self.get(key)

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class Correlator:
    """client-go's ``EventCorrelator``: aggregation of similar Events, then counting of
    identical ones, then a token bucket per object; ``now`` in Unix seconds."""

    def __init__(
        self,
        *,
        burst: int = SPAM_BURST,
        refill_s: float = SPAM_REFILL_S,
        aggregate_after: int = AGGREGATE_AFTER,
        aggregate_window_s: float = AGGREGATE_WINDOW_S,
        entries: int = CACHE_ENTRIES,
    ) -> None:
        self.burst, self.refill_s = burst, refill_s
        self.aggregate_after, self.aggregate_window_s = aggregate_after, aggregate_window_s
        self._similar = _Lru(entries)  # aggregate key -> (messages, last seen)
        self._seen = _Lru(entries)  # event key -> (count, firstTimestamp, name)
        self._buckets = _Lru(entries)  # object key -> (tokens, at)

    def correlate(self, body: dict[str, Any], now: float) -> Correlated | None:
        """What to write for the new Event ``body`` (None: the object's budget is spent)."""
        body, key = self._aggregate(body, now)
        count, first, name = self._seen.get_fresh(key) or (0, None, None)
        patch = None
        if count:
            body = {
                **body,
                "metadata": {**body["metadata"], "name": name},
                "firstTimestamp": first,
                "count": count + 1,
            }
            patch = {
                "count": count + 1,
                "lastTimestamp": body["lastTimestamp"],
                "message": body["message"],
            }
        self._seen.put(key, (body["count"], body["firstTimestamp"], body["metadata"]["name"]))
        if not self._accept(_object_key(body), now):
            return None
        return Correlated(body, patch)

    def forget(self, body: dict[str, Any]) -> None:
        """The Event ``body`` names is gone from the server (a patch found none): the next
        identical one is created anew, as client-go creates it."""
        for key, (_, _, name) in list(self._seen.items()):
            if name == body["metadata"]["name"]:
                del self._seen[key]

    def _aggregate(self, body: dict[str, Any], now: float) -> tuple[dict[str, Any], str]:
        similar = _object_key(body) + (body["type"], body["reason"])
        key = "\x00".join(similar)
        messages, last = self._similar.get_fresh(key) or (frozenset(), None)
        if last is None or now - last > self.aggregate_window_s:
            messages = frozenset()
        messages = messages | {body["message"]}
        if len(messages) < self.aggregate_after:
            self._similar.put(key, (messages, now))
            return body, "\x00".join((*similar, body["message"]))
        self._similar.put(key, (frozenset(list(messages)[1:]), now))
        combined = {**body, "message": clip(COMBINED + body["message"])}
        return combined, key

    def _accept(self, key: tuple[str, ...], now: float) -> bool:
        name = "\x00".join(key)
        tokens, at = self._buckets.get_fresh(name) or (float(self.burst), now)
        tokens = min(float(self.burst), tokens + (now - at) / self.refill_s)
        accepted = tokens >= 1.0
        self._buckets.put(name, (tokens - 1.0 if accepted else tokens, now))
        return accepted


def _object_key(body: dict[str, Any]) -> tuple[str, ...]:
    source, ref = body["source"], body["involvedObject"]
    return (
        source.get("component", ""),
        source.get("host", ""),
        *(ref.get(k, "") for k in ("kind", "namespace", "name", "uid", "apiVersion")),
    )


def timestamp(now: float) -> str:
    """``now`` as the API server writes a ``metav1.Time`` (RFC 3339, seconds, UTC)."""
    return datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(
    event: PodEvent, reference: dict[str, str], instance: str, now: float, name: str
) -> dict[str, Any]:
    """The core/v1 Event of ``event`` about ``reference``, seen once at ``now``, as client-go's
    recorder makes it (``source`` and ``reportingComponent``/``reportingInstance`` alike)."""
    stamp = timestamp(now)
    source = {"component": COMPONENT, **({"host": instance} if instance else {})}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": reference["namespace"]},
        "involvedObject": reference,
        "reason": event.reason,
        "message": clip(event.message),
        "type": event.type,
        "source": source,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
    }


class EventRecorder:
    """Records the Events of the timeline events it is given (:meth:`record`) in ``namespace``
    through ``api_client`` (a ``kubernetes.client.ApiClient``; the caller's to close, after
    :meth:`close`). ``own_pod``: the master's pod, which job-level Events are about (None: the
    master runs in no pod, and they are not recorded); ``own_uid``: its uid, when known (else
    looked up, as every worker pod's is, by a list of that one name). ``seen``: what the
    timeline held already (``pod_events.seen_after``)."""

    def __init__(
        self,
        namespace: str,
        api_client: Any,
        *,
        own_pod: str | None,
        own_uid: str | None = None,
        instance: str = "",
        seen: Seen | None = None,
        correlator: Correlator | None = None,
        clock: Callable[[], float] = time.time,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.namespace = namespace
        self.own_pod = own_pod
        self.instance = instance[:128]  # reportingInstance's limit
        self.seen = seen or Seen()
        self.correlator = correlator or Correlator()
        self.clock = clock
        self.api_client = api_client
        self._core = client.CoreV1Api(api_client)
        self._uids = _Lru(CACHE_ENTRIES)
        if own_pod and own_uid:
            self._uids.put(own_pod, own_uid)
        self._queue: queue.Queue[Event | None] = queue.Queue(max_queued)
        self._warned: set[str] = set()
        self._last_ns = 0
        self._closed = False
        self.written = 0  # Events created or patched (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="k8s-events", daemon=True)

    def start(self) -> EventRecorder:
        self._thread.start()
        return self

    # -- the master's side: never blocks ----------------------------------------------------
    def record(self, event: Event) -> None:
        """Queue ``event``'s Event, if it has one (dropped when the queue is full)."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._warn_once("full", "event queue full: Events dropped", queued=self._queue.qsize())

    def close(self, flush_s: float = FLUSH_S) -> None:
        """Stop after the queued Events are written, waiting ``flush_s`` at most."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=flush_s)
        except queue.Full:
            return
        if self._thread.is_alive():
            self._thread.join(flush_s)

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            try:
                self._handle(event)
            except Exception as error:  # noqa: BLE001 - an Event is never worth the master
                self._warn_once(type(error).__name__, "event not recorded", error=repr(error))

    def _handle(self, event: Event) -> None:
        out, self.seen = pod_event(event, self.seen)
        if out is None:
            return
        pod = out.pod or self.own_pod
        if pod is None:  # a job-level Event, and no pod of the master's to hang it on
            log.debug("event not recorded (the master runs in no pod) reason=%s", out.reason)
            return
        now = self.clock()
        reference = {"kind": "Pod", "apiVersion": "v1", "namespace": self.namespace, "name": pod}
        uid = self._uid(pod)
        if uid:
            reference["uid"] = uid
        body = event_body(out, reference, self.instance, now, f"{pod}.{self._unique_ns(now):x}")
        correlated = self.correlator.correlate(body, now)
        if correlated is None:
            log.debug("event dropped (its object's budget spent) pod=%s reason=%s", pod, out.reason)
            return
        self._write(correlated)

    def _unique_ns(self, now: float) -> int:
        """``now`` in nanoseconds, above every earlier Event's: client-go's ``name.<hex>``."""
        self._last_ns = max(int(now * 1e9), self._last_ns + 1)
        return self._last_ns

    def _uid(self, pod: str) -> str | None:
        uid = self._uids.get_fresh(pod)
        if uid is not None:
            return uid or None
        try:
            response = self._core.list_namespaced_pod(
                self.namespace,
                field_selector=f"metadata.name={pod}",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            items = json.loads(response.data).get("items") or []
        except ApiException as error:
            self._api_failure(error, "list pods")
            return None
        except Exception as error:  # noqa: BLE001 - the Event goes without the uid
            self._warn_once(type(error).__name__, "pod uid not read", error=repr(error))
            return None
        uid = str(items[0]["metadata"].get("uid", "")) if items else ""
        self._uids.put(pod, uid)  # "": gone; the Event names the pod without its uid
        return uid or None

    def _write(self, correlated: Correlated) -> None:
        body = correlated.body
        name = body["metadata"]["name"]
        try:
            if correlated.patch is not None:
                try:
                    self._core.patch_namespaced_event(
                        name,
                        self.namespace,
                        correlated.patch,  # a dict: a strategic merge patch, as client-go's
                        _preload_content=False,
                        _request_timeout=REQUEST_TIMEOUT_S,
                    )
                    self.written += 1
                    return
                except ApiException as error:
                    if error.status != 404:
                        raise
                    self.correlator.forget(body)  # gone (its TTL): a new one, count 1
                    body = {**body, "count": 1, "firstTimestamp": body["lastTimestamp"]}
            self._core.create_namespaced_event(
                self.namespace, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
            self.written += 1
            log.debug(
                "event recorded pod=%s reason=%s count=%s",
                body["involvedObject"]["name"],
                body["reason"],
                body["count"],
            )
        except ApiException as error:
            verb = "patch" if correlated.patch is not None else "create"
            self._api_failure(error, f"{verb} events")

    def _api_failure(self, error: ApiException, call: str) -> None:
        if error.status == 403:
            self._warn_once(
                f"403 {call}",
                f"Events not recorded: the master may not {call} in namespace "
                f"{self.namespace}; grant it in its Role ({ROLE_SOURCE}) to see its decisions "
                "in kubectl get events",
                error=_status_message(error),
            )
        else:
            self._warn_once(
                f"{error.status} {call}",
                "event not recorded",
                call=call,
                status=error.status,
                error=_status_message(error),
            )

    def _warn_once(self, kind: str, what: str, **fields: Any) -> None:
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        if kind in self._warned:
            log.debug("%s %s", what, details)
            return
        self._warned.add(kind)
        log.warning("%s %s (said once)", what, details)


def _status_message(error: ApiException) -> str:
    try:
        body = error.body.decode() if isinstance(error.body, bytes) else error.body
        return str(json.loads(body or "{}").get("message", error.reason))
    except (ValueError, AttributeError):
        return str(error.reason)
