"""The run's event timeline: typed events, their JSON form, and the one reader/tailer.

The master appends events under ``{run}/events/{seq:010d}`` (``MasterState.append_event``;
keys: ``kfp_elastic.etcd.keys.TimelineKeys``); metrics, the component's summary, report,
progress lines and fault injection read them back through :func:`read_timeline` or
:class:`TimelineTail`. Every kind is an :class:`EventKind` and a frozen dataclass below; no other
module spells a kind as a string.

Forward compatible: a newer master may write kinds or fields this reader does not know. An
unknown kind becomes an :class:`UnknownEvent` (its fields kept as they were), an unknown field
of a known kind is kept in ``extra``, and a field whose value does not fit its type falls back
to the default (the raw value kept in ``extra``); none of that raises. Writing an event back
gives the same JSON.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import TimelineKeys, prefix_range_end

log = logging.getLogger(__name__)


class EventKind(str, enum.Enum):
    MASTER_STARTED = "master_started"
    MASTER_RECOVERED = "master_recovered"
    MASTER_STEPPED_DOWN = "master_stepped_down"
    WORKER_LAUNCHED = "worker_launched"
    WORKER_RUNNING = "worker_running"
    LAUNCH_FAILED = "launch_failed"
    WORKER_LOST = "worker_lost"
    WORKER_COMPLETED = "worker_completed"
    FAILURE_COUNTED = "failure_counted"
    ROUND_FORMED = "round_formed"
    COMMITTED = "committed"
    EPOCH_END = "epoch_end"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    LADDER_MOVED = "ladder_moved"
    MODEL_DEF_CHECKED = "model_def_checked"
    # Not in etcd: the elastic_train component's own record of a fault it injected.
    FAULT_INJECTED = "fault_injected"


@dataclass(frozen=True, kw_only=True)
class Event:
    """Fields every event has. ``t``: the master's unix time; ``seq``: its place on the
    timeline (from the key, 0 for an event not read from etcd); ``extra``: fields this reader
    does not know (written back unchanged)."""

    kind: ClassVar[EventKind]
    t: float = 0.0
    seq: int = field(default=0, compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def kind_name(self) -> str:
        return self.kind.value

    def payload(self) -> dict[str, Any]:
        """The event's own fields (without t, seq, extra), JSON-ready."""
        return {
            f.name: _jsonable(getattr(self, f.name))
            for f in fields(self)
            if f.name not in _BASE_FIELDS
        }


_BASE_FIELDS = frozenset({"t", "seq", "extra"})


@dataclass(frozen=True, kw_only=True)
class MasterStarted(Event):
    kind = EventKind.MASTER_STARTED
    master: str = ""
    run_id: str = ""
    min_workers: int = 0
    max_workers: int = 0
    nproc_per_worker: int = 0
    launcher: str = ""


@dataclass(frozen=True, kw_only=True)
class MasterRecovered(Event):
    kind = EventKind.MASTER_RECOVERED
    master: str = ""
    workers: tuple[str, ...] = ()  # live workers the new master adopted
    failures: int = 0


@dataclass(frozen=True, kw_only=True)
class MasterSteppedDown(Event):
    """The leader hands the run over (SIGTERM, or its pod being deleted): its last write before
    it releases the leadership; the workers keep running for the next master."""

    kind = EventKind.MASTER_STEPPED_DOWN
    master: str = ""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerLaunched(Event):
    """A worker pod (process) created. ``replaces``: the worker of the same index it takes the
    place of (empty: the index's first), ``replaces_cause`` why that one went, as far as the
    master knew at the launch (a cause of ``worker_lost``; its ``worker_lost`` may come later,
    once its pod is gone)."""

    kind = EventKind.WORKER_LAUNCHED
    name: str = ""
    index: int = 0
    attempt: int = 0
    replaces: str = ""
    replaces_cause: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerRunning(Event):
    """The master first saw the worker's pod (process) Running: from here it holds a slot
    (``master.cost``)."""

    kind = EventKind.WORKER_RUNNING
    name: str = ""
    index: int | None = None


@dataclass(frozen=True, kw_only=True)
class LaunchFailed(Event):
    kind = EventKind.LAUNCH_FAILED
    index: int = 0
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerLost(Event):
    kind = EventKind.WORKER_LOST
    name: str = ""
    index: int | None = None
    exit_code: int | None = None
    cause: str = ""  # master.scaling's causes: preempted, failed, node_lost, ...
    failure: bool = False  # ended with an error (its agent's failures are counted already)
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerCompleted(Event):
    kind = EventKind.WORKER_COMPLETED
    name: str = ""
    index: int | None = None
    exit_code: int | None = None


@dataclass(frozen=True, kw_only=True)
class FailureCounted(Event):
    """A failure counted against the job's budget (``failure_budget.CountedFailure``): by an
    agent that restarts its workers in place or gives up, or by the master."""

    kind = EventKind.FAILURE_COUNTED
    incident: str = ""
    source: str = ""
    worker: str = ""
    node: str = ""
    rank: int | None = None
    round: int | None = None
    fatal: bool = False
    error: str = ""
    count: int = 0  # counted failures so far, this one included


@dataclass(frozen=True, kw_only=True)
class RoundFormed(Event):
    kind = EventKind.ROUND_FORMED
    round: int = 0
    nodes: int = 0
    world_size: int = 0
    participants: tuple[str, ...] = ()
    formed_at: float = 0.0  # the forming leader's unix time (0.0: not known, use ``t``)


@dataclass(frozen=True, kw_only=True)
class Committed(Event):
    kind = EventKind.COMMITTED
    step: int = 0
    epoch: int = 0
    position: int = 0
    world_size: int = 0
    losses: tuple[float, ...] = ()  # mean loss of each step since the previous commit
    complete: bool = False
    snapshot: str = ""
    rescued: bool = False
    stopping: bool = False  # the world's last step before it stopped: it lost nothing
    global_batch: int | None = None
    lr: float | None = None
    at: float = 0.0  # rank 0's unix time of the commit (0.0: not known, use ``t``)
    round: int = 0  # the round of the world that committed (0: not known)


@dataclass(frozen=True, kw_only=True)
class EpochEnd(Event):
    kind = EventKind.EPOCH_END
    epoch: int = 0
    step: int = 0


@dataclass(frozen=True, kw_only=True)
class JobDone(Event):
    kind = EventKind.JOB_DONE
    message: str = ""
    failures: int = 0


@dataclass(frozen=True, kw_only=True)
class JobFailed(Event):
    kind = EventKind.JOB_FAILED
    message: str = ""
    failures: int = 0


@dataclass(frozen=True, kw_only=True)
class FaultInjected(Event):
    kind = EventKind.FAULT_INJECTED
    action: str = ""
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class LadderMoved(Event):
    """The job moved on the least-attained-service ladder (``master/ladder.py``): its guaranteed
    workers are re-created in ``priority_class`` from now on."""

    kind = EventKind.LADDER_MOVED
    from_level: int = 0
    level: int = 0
    priority_class: str = ""
    action: str = ""  # a LadderAction value: demote or promote_starved
    attained_gpu_s: float = 0.0
    service_gpu_s: float = 0.0  # since the job last entered level 0
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelDefChecked(Event):
    """The check of the model definition (``master/preflight.py``: loaded as a worker loads it,
    its dataset's samples) ended; it runs while the first worker pods are created, so on the
    timeline it comes after their ``worker_launched`` events when it is the slower. A failed
    check is followed by ``job_failed`` with the same message."""

    kind = EventKind.MODEL_DEF_CHECKED
    passed: bool = True
    seconds: float = 0.0  # how long the check ran
    message: str = ""  # what failed (empty when it passed)


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A kind this reader does not know (a newer master wrote it): its fields are in ``extra``."""

    kind = None  # type: ignore[assignment]
    name: str = ""

    @property
    def kind_name(self) -> str:
        return self.name

    def payload(self) -> dict[str, Any]:
        return {}


EVENT_TYPES: dict[EventKind, type[Event]] = {
    cls.kind: cls
    for cls in (
        MasterStarted,
        MasterRecovered,
        MasterSteppedDown,
        WorkerLaunched,
        WorkerRunning,
        LaunchFailed,
        WorkerLost,
        WorkerCompleted,
        FailureCounted,
        RoundFormed,
        Committed,
        EpochEnd,
        JobDone,
        JobFailed,
        FaultInjected,
        LadderMoved,
        ModelDefChecked,
    )
}
#: The events that end a job.
END_KINDS = frozenset({EventKind.JOB_DONE, EventKind.JOB_FAILED})


# -- JSON ----------------------------------------------------------------------------------------
def to_record(event: Event) -> dict[str, Any]:
    """``{"t", "kind", **fields, **extra}`` (``seq`` is the key's, not the value's)."""
    return {"t": event.t, "kind": event.kind_name, **event.payload(), **dict(event.extra)}


def to_json(event: Event) -> str:
    return json.dumps(to_record(event))


def from_record(record: Mapping[str, Any], seq: int = 0) -> Event:
    """The typed event of a JSON record; never raises on unknown kinds or fields."""
    data = dict(record)
    name = str(data.pop("kind", ""))
    t = _coerce(float, data.pop("t", 0.0), 0.0)
    data.pop("seq", None)
    try:
        cls = EVENT_TYPES[EventKind(name)]
    except ValueError:
        return UnknownEvent(t=t, seq=seq, name=name, extra=data)
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in _BASE_FIELDS or f.name not in data:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        converted = _coerce(hints[f.name], data[f.name], _INVALID)
        if converted is _INVALID:
            log.warning(
                "timeline event field has an unexpected type kind=%s field=%s seq=%d",
                name,
                f.name,
                seq,
            )
            values[f.name] = default
            continue  # stays in ``data``: kept in extra
        values[f.name] = converted
        del data[f.name]
    return cls(t=t, seq=seq, extra=data, **values)


def from_json(text: str | bytes, seq: int = 0) -> Event:
    """Raises ValueError only when ``text`` is not a JSON object."""
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError(f"a timeline event is a JSON object, got {type(record).__name__}")
    return from_record(record, seq)


_INVALID = object()


@typing.no_type_check
def _hints(cls: type[Event]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(hint: Any, value: Any, invalid: Any) -> Any:
    """``value`` as type ``hint`` (int, float, str, bool, X | None, tuple[X, ...])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None if type(None) in args else invalid
    if args and type(None) in args:  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, invalid)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return invalid
        items = tuple(_coerce(args[0], item, invalid) for item in value)
        return invalid if any(item is invalid for item in items) else items
    if hint is bool:
        return value if isinstance(value, bool) else invalid
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return invalid
        if hint is int and not float(value).is_integer():
            return invalid
        return hint(value)
    if hint is str:
        return value if isinstance(value, str) else str(value)
    return value


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- reading -------------------------------------------------------------------------------------
def _parse(value: bytes, key: bytes, keys: TimelineKeys) -> Event | None:
    seq = keys.seq_of(key)
    try:
        return from_json(value, seq)
    except ValueError as error:
        log.warning("unreadable timeline event seq=%d error=%r", seq, error)
        return None


def read_timeline(client: MultiEndpointEtcd3Client, run_prefix: str) -> list[Event]:
    """Every event of a run, oldest first."""
    return TimelineTail(client, run_prefix, watch=False).read()


class TimelineTail:
    """The events of a run in order: :meth:`read` returns those not returned before (a range
    read after the last sequence number), :meth:`wait` sleeps until a new one is written.

    The watch only wakes the reader; what is read always comes from a range read, so a broken
    or compacted watch loses nothing (it is set up again on the next :meth:`wait`)."""

    def __init__(
        self, client: MultiEndpointEtcd3Client, run_prefix: str, *, watch: bool = True
    ) -> None:
        self._client = client
        self._keys = TimelineKeys(run_prefix.rstrip("/"))
        self._end = prefix_range_end(self._keys.root)
        self._watch = watch
        self._watch_id: int | None = None
        self._written = threading.Event()
        self.events: list[Event] = []

    def read(self) -> list[Event]:
        start = self._keys.event(self.events[-1].seq + 1) if self.events else self._keys.root
        new = []
        for value, meta in self._client.get_range(
            start, self._end, sort_order="ascend", sort_target="key"
        ):
            event = _parse(value, meta.key, self._keys)
            if event is not None:
                new.append(event)
        self.events.extend(new)
        return new

    def wait(self, timeout: float) -> bool:
        """Until an event key is written (True) or ``timeout`` passes (False)."""
        if not self._watch:
            raise RuntimeError("this tail was created with watch=False")
        if self._watch_id is None:
            try:
                self._watch_id = self._client.add_watch_prefix_callback(
                    self._keys.root, self._on_watch
                )
            except Exception as error:  # noqa: BLE001 - etcd away: the timeout still wakes us
                log.warning("timeline watch failed error=%r", error)
        woke = self._written.wait(timeout)
        self._written.clear()
        return woke

    def _on_watch(self, response: Any) -> None:
        if isinstance(response, BaseException) or response is None:
            self._watch_id = None  # broken (etcd restarted, compacted): re-read, watch again
        self._written.set()

    def close(self) -> None:
        if self._watch_id is not None:
            try:
                self._client.cancel_watch(self._watch_id)
            except Exception:  # noqa: BLE001 - a broken stream has nothing to cancel
                pass
            self._watch_id = None

    def __enter__(self) -> TimelineTail:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


E = typing.TypeVar("E", bound=Event)


def of_type(events: Iterable[Event], cls: type[E]) -> list[E]:
    """The events of one type, in order."""
    return [e for e in events if isinstance(e, cls)]
