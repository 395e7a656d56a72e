"""master.metrics: timeline fold (pure), the prometheus-client collector, HTTP endpoint."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kfp_elastic.master.cost import Cost
from kfp_elastic.master.metrics import Metrics, Snapshot, TimelineStats, render
from kfp_elastic.master.timeline import Committed, RoundFormed

T0 = 1_700_000_000.0  # worker times; the master's are 100 s later


def commit(
    t: float,
    step: int,
    rescued: bool = False,
    stopping: bool = False,
    world: int = 2,
    in_round: int = 0,
) -> Committed:
    """A commit at worker time ``t`` (an older writer's, without a round, when ``in_round``
    is 0: it counts in the latest round on the timeline)."""
    return Committed(
        t=T0 + t + 100,
        at=T0 + t,
        step=step,
        rescued=rescued,
        stopping=stopping,
        world_size=world,
        round=in_round,
    )


def round_formed(t: float, number: int, world: int = 2) -> RoundFormed:
    return RoundFormed(t=T0 + t + 100, formed_at=T0 + t, round=number, world_size=world)


def test_restarts_count_rounds_after_the_first_including_unseen_ones() -> None:
    stats = TimelineStats().add_all([round_formed(0, 1), round_formed(5, 2), round_formed(9, 5)])
    assert stats.rounds == 5 and stats.restarts == 4
    stats.add(round_formed(20, 1))  # the run's keys expired and rounds count from 1 again
    assert stats.restarts == 5 and stats.world_size == 2


def test_lost_steps_after_a_round_change_are_estimated_and_capped() -> None:
    # One step per second, a commit every 4 steps; the round breaks 2 s after a commit.
    events = [round_formed(0, 1), commit(4, 4), commit(8, 8), commit(12, 12), round_formed(14, 2)]
    stats = TimelineStats().add_all(events)
    assert stats.steps_total == 12 and stats.rate() == pytest.approx(1.0)
    assert stats.lost_steps == 2
    stats.add(round_formed(40, 3))  # a long wait: never more than one commit interval
    assert stats.lost_steps == 2 + 4


def test_a_rescued_commit_after_a_round_change_takes_the_estimate_back() -> None:
    events = [
        round_formed(0, 1),
        commit(4, 4),
        commit(8, 8),
        commit(12, 12),
        round_formed(14, 2),
        round_formed(15, 3),
    ]
    stats = TimelineStats().add_all(events)
    assert stats.lost_steps == 3
    stats.add(commit(16, 14, rescued=True))  # survivors kept steps 13 and 14
    assert stats.lost_steps == 0 and stats.steps_total == 14
    stats.add_all([commit(20, 18), round_formed(22, 4), commit(24, 18)])  # a plain restore
    assert stats.lost_steps == 1  # 2 s at 0.875 steps/s: the estimate stands


def test_a_world_that_stopped_with_a_commit_lost_nothing() -> None:
    # A preemption: the world of 2 stops at a commit (SIGTERM), then the round of 1 forms.
    preempted = [round_formed(0, 1), commit(4, 4), commit(8, 8), commit(9, 9, stopping=True)]
    stats = TimelineStats().add_all([*preempted, round_formed(11, 2, world=1)])
    assert stats.lost_steps == 0
    # A join: the round of 3 forms first, then the world of 2 stops at a commit.
    stats.add_all([commit(15, 13, world=1), round_formed(18, 3, world=3)])
    assert stats.lost_steps > 0  # the estimate, until...
    stats.add(commit(18.5, 16, stopping=True, world=1, in_round=2))  # the old world's
    assert stats.lost_steps == 0
    # ... and the world of 3 that trains on and then breaks without a commit loses steps.
    stats.add_all([commit(22, 20, world=3), commit(24, 22, world=3), round_formed(28, 4, world=2)])
    assert stats.lost_steps > 0


def test_a_committed_step_going_backwards_counts_the_difference() -> None:
    stats = TimelineStats().add_all([commit(1, 10), commit(2, 20), commit(3, 15), commit(4, 16)])
    assert stats.lost_steps == 5 and stats.steps_total == 16


SNAPSHOT = Snapshot(
    world_size=3,
    workers={"Running": 3},
    restarts=1,
    shard_queue={(0, "done"): 4, (1, "todo"): 8},
    committed_step=40,
    steps_per_second=2.5,
    lost_steps=3,
    failures=1,
    cost=Cost(
        slot_seconds={"guaranteed": 7200.0, "opportunistic": 3600.0},
        cost={"guaranteed": 6.0, "opportunistic": 1.0},
        fixed_cost=10.0,
    ),
)


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, through prometheus-client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_collector_output_parses_with_the_documented_names_and_types() -> None:
    text = render(SNAPSHOT)
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types == {
        "kfp_elastic_world_size": "gauge",
        "kfp_elastic_workers": "gauge",
        "kfp_elastic_restarts": "counter",
        "kfp_elastic_shard_queue": "gauge",
        "kfp_elastic_committed_step": "gauge",
        "kfp_elastic_steps_per_second": "gauge",
        "kfp_elastic_lost_steps": "gauge",
        "kfp_elastic_worker_failures": "counter",
        "kfp_elastic_slot_seconds": "counter",
        "kfp_elastic_cost": "gauge",
        "kfp_elastic_fixed_size_cost": "gauge",
        "kfp_elastic_cost_saving": "gauge",
    }
    samples = samples_of(text)
    assert samples[("kfp_elastic_world_size", ())] == 3
    assert samples[("kfp_elastic_workers", (("phase", "Running"),))] == 3
    assert samples[("kfp_elastic_workers", (("phase", "Pending"),))] == 0  # every phase shown
    assert samples[("kfp_elastic_shard_queue", (("epoch", "1"), ("state", "todo")))] == 8
    assert samples[("kfp_elastic_committed_step", ())] == 40
    assert samples[("kfp_elastic_steps_per_second", ())] == 2.5
    assert samples[("kfp_elastic_restarts_total", ())] == 1
    assert samples[("kfp_elastic_lost_steps", ())] == 3
    assert samples[("kfp_elastic_worker_failures_total", ())] == 1
    assert samples[("kfp_elastic_slot_seconds_total", (("tier", "guaranteed"),))] == 7200
    assert samples[("kfp_elastic_slot_seconds_total", (("tier", "opportunistic"),))] == 3600
    assert samples[("kfp_elastic_cost", (("tier", "guaranteed"),))] == 6.0
    assert samples[("kfp_elastic_cost", (("tier", "opportunistic"),))] == 1.0
    assert samples[("kfp_elastic_fixed_size_cost", ())] == 10.0
    assert samples[("kfp_elastic_cost_saving", ())] == 3.0


def test_without_prices_only_slot_seconds_are_shown() -> None:
    """No prices given: slot-seconds per tier, and no money series rather than zeros."""
    text = render(Snapshot(cost=Cost(slot_seconds={"guaranteed": 5.0, "opportunistic": 0.0})))
    names = {name for name, _ in samples_of(text)}
    assert "kfp_elastic_slot_seconds_total" in names
    assert not {"kfp_elastic_cost", "kfp_elastic_fixed_size_cost"} & names


def test_every_documented_metric_is_exposed() -> None:
    """docs/master.md's metrics table and the collector name the same series."""
    table = (Path(__file__).resolve().parents[3] / "docs" / "master.md").read_text()
    documented = set(re.findall(r"^\| `(kfp_elastic_[a-z_]+)", table, re.MULTILINE))
    exposed = {name for name, _ in samples_of(render(SNAPSHOT))}
    assert documented == exposed


def test_metrics_endpoint_serves_the_current_snapshot_and_closes() -> None:
    metrics = Metrics()
    port = metrics.serve(0, "127.0.0.1")
    try:
        metrics.update(world_size=2, committed_step=7)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            samples = samples_of(reply.read().decode())
        assert samples[("kfp_elastic_world_size", ())] == 2
        assert samples[("kfp_elastic_committed_step", ())] == 7
        metrics.update(world_size=3)  # every scrape reads the latest snapshot
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert samples_of(reply.read().decode())[("kfp_elastic_world_size", ())] == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            assert reply.read() == b"ok\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    finally:
        metrics.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
