"""master.timeline: typed events, their JSON form (forward compatible), the one reader/tailer."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import TimelineKeys
from kfp_elastic.master import timeline
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import (
    EVENT_TYPES,
    Committed,
    EventKind,
    JobDone,
    MasterRecovered,
    MasterStarted,
    RoundFormed,
    TimelineTail,
    UnknownEvent,
    WorkerLaunched,
    WorkerLost,
    from_json,
    from_record,
    of_type,
    read_timeline,
    to_json,
)

ROOT = Path(__file__).resolve().parents[3]

SAMPLES = [
    MasterStarted(t=1.0, master="m", run_id="r", min_workers=1, max_workers=3, launcher="local"),
    MasterRecovered(t=2.0, master="m2", workers=("worker-0-0", "worker-1-0"), failures=1),
    WorkerLaunched(t=3.0, name="worker-0-0", index=0, attempt=2),
    WorkerLost(t=4.0, name="worker-1-0", index=1, cause="preempted", message="SIGTERM"),
    RoundFormed(t=5.0, round=2, nodes=2, world_size=4, participants=("a", "b")),
    Committed(t=6.0, step=10, epoch=1, losses=(0.5, 0.25), rescued=True, lr=0.1),
    JobDone(t=7.0, message="done", failures=1),
]


def test_every_kind_has_one_event_type() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    assert all(cls.kind is kind for kind, cls in EVENT_TYPES.items())


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind_name)
def test_events_round_trip_through_json(event: timeline.Event) -> None:
    text = to_json(event)
    assert json.loads(text)["kind"] == event.kind.value
    back = from_json(text, seq=9)
    assert back == event and type(back) is type(event) and back.seq == 9
    assert to_json(back) == text


def test_records_of_older_masters_read_with_defaults() -> None:
    event = from_record({"kind": "worker_lost", "t": 3, "name": "w"})
    assert isinstance(event, WorkerLost) and event.t == 3.0 and event.name == "w"
    assert (event.cause, event.failure, event.index) == ("", False, None)


def test_an_unknown_kind_is_kept_as_a_generic_event() -> None:
    text = json.dumps({"t": 5.0, "kind": "gpu_swapped", "node": "n1", "gpus": [0, 1]})
    event = from_json(text, seq=4)
    assert isinstance(event, UnknownEvent) and event.kind_name == "gpu_swapped"
    assert event.extra == {"node": "n1", "gpus": [0, 1]} and event.seq == 4
    assert json.loads(to_json(event)) == json.loads(text)  # written back unchanged


def test_unknown_fields_and_mistyped_values_do_not_break_a_reader() -> None:
    record = {"kind": "committed", "t": 1, "step": "eleven", "epoch": 2, "tokens": 1024}
    event = from_record(record)
    assert isinstance(event, Committed)
    assert event.step == 0 and event.epoch == 2  # the bad value falls back to the default
    assert event.extra == {"step": "eleven", "tokens": 1024}
    assert json.loads(to_json(event))["step"] == "eleven"  # and is written back as it was


def test_not_an_object_is_an_error_the_reader_skips() -> None:
    with pytest.raises(ValueError):
        from_json("[1, 2]")


def test_of_type_selects_in_order() -> None:
    assert of_type(SAMPLES, WorkerLaunched) == [SAMPLES[2]]
    assert [e.kind for e in of_type(SAMPLES, timeline.Event)] == [e.kind for e in SAMPLES]


# -- reader and tailer against etcd -------------------------------------------------------------
@pytest.fixture
def state(client: MultiEndpointEtcd3Client, run_id: str) -> Iterator[MasterState]:
    master = MasterState(client, f"/kfp-elastic/{run_id}", lease_ttl=2)
    assert master.acquire(timeout=5)
    yield master
    master.release()


def test_tail_reads_only_new_events_and_skips_unreadable_ones(
    client: MultiEndpointEtcd3Client, state: MasterState, run_id: str
) -> None:
    prefix = f"/kfp-elastic/{run_id}"
    with TimelineTail(client, prefix) as tail:
        assert tail.read() == []
        state.append_event(MasterStarted(min_workers=1))
        state.append_event(WorkerLaunched(name="worker-0-0"))
        assert [type(e) for e in tail.read()] == [MasterStarted, WorkerLaunched]
        client.put(TimelineKeys(prefix).event(3), "not json")  # a damaged key
        client.put(TimelineKeys(prefix).event(4), json.dumps({"kind": "future", "t": 1}))
        new = tail.read()
        assert [(e.kind_name, e.seq) for e in new] == [("future", 4)]
        assert tail.read() == [] and len(tail.events) == 3
    assert [e.seq for e in read_timeline(client, prefix)] == [1, 2, 4]


def test_tail_wait_wakes_on_a_new_event(
    client: MultiEndpointEtcd3Client, state: MasterState, run_id: str
) -> None:
    with TimelineTail(client, f"/kfp-elastic/{run_id}") as tail:
        assert tail.wait(0.2) is False  # nothing written: the timeout ends the wait
        threading.Timer(0.3, lambda: state.append_event(JobDone(message="ok"))).start()
        assert tail.wait(30) is True
        (event,) = tail.read()
        assert isinstance(event, JobDone) and event.message == "ok"


# -- one module knows the kinds -------------------------------------------------------------------
def test_no_bare_kind_strings_outside_the_timeline_module() -> None:
    kinds = "|".join(kind.value for kind in EventKind)
    bare = re.compile(rf"[\"'](?:{kinds})[\"']")
    offenders = []
    for folder in ("kfp_elastic",):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(timeline.__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if bare.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_components_progress_lines_come_from_the_tail(
    client: MultiEndpointEtcd3Client, state: MasterState, run_id: str
) -> None:
    """elastic_train's watcher thread: one line per typed event, no "(progress: ...)" errors."""
    from kfp_elastic.components.elastic_train.faults import FaultInjector
    from kfp_elastic.components.elastic_train.run_job import _watch

    state.append_event(RoundFormed(round=1, nodes=2, world_size=2))
    state.append_event(JobDone(message="ok"))
    stop = threading.Event()
    stop.set()  # one pass, then return
    lines: list[str] = []
    injector = FaultInjector((), lambda: [], lambda action, name: None)
    _watch(TimelineTail(client, f"/kfp-elastic/{run_id}"), injector, stop, lines.append)
    assert [line.split("] ", 1)[1] for line in lines] == [
        "round 1 formed: world size 2 (2 workers)",
        "job succeeded: ok",
    ]
