"""elastic_train's metrics, progress lines and HTML report, from made-up timelines (pure)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from kfp_elastic.components.elastic_train.report import loss_segments, render, svg_chart
from kfp_elastic.components.elastic_train.summary import Summary, describe, summarize
from kfp_elastic.contract.prices import Prices
from kfp_elastic.master.timeline import Event, from_record

T0 = 1_000.0


def timeline() -> list[Event]:
    """2 workers, worker-1 preempted after step 10, replaced, job done at step 30."""
    events = [
        (
            "master_started",
            0.0,
            {"min_workers": 1, "max_workers": 2, "nproc_per_worker": 1, "launcher": "local"},
        ),
        ("worker_launched", 0.1, {"name": "worker-0-0", "index": 0}),
        ("worker_launched", 0.1, {"name": "worker-1-0", "index": 1}),
        ("round_formed", 5.0, {"round": 1, "nodes": 2, "world_size": 2}),
        (
            "committed",
            7.0,
            {
                "step": 5,
                "epoch": 0,
                "world_size": 2,
                "round": 1,
                "losses": [2.0, 1.9, 1.8, 1.7, 1.6],
            },
        ),
        (
            "committed",
            9.0,
            {
                "step": 10,
                "epoch": 0,
                "world_size": 2,
                "round": 1,
                "losses": [1.5, 1.4, 1.3, 1.2, 1.1],
            },
        ),
        (
            "worker_lost",
            11.0,
            {
                "name": "worker-1-0",
                "index": 1,
                "cause": "preempted",
                "failure": False,
                "message": "terminated by SIGTERM",
            },
        ),
        ("worker_launched", 11.1, {"name": "worker-1-1", "index": 1}),
        ("round_formed", 12.0, {"round": 2, "nodes": 1, "world_size": 1}),
        ("round_formed", 20.0, {"round": 3, "nodes": 2, "world_size": 2}),
        (
            "committed",
            22.0,
            {"step": 20, "epoch": 0, "world_size": 2, "round": 3, "losses": [1.0] * 10},
        ),
        ("epoch_end", 22.1, {"epoch": 0, "step": 20}),
        (
            "committed",
            24.0,
            {
                "step": 30,
                "epoch": 1,
                "world_size": 2,
                "round": 3,
                "complete": True,
                "losses": [0.5] * 9 + [0.25],
            },
        ),
        ("epoch_end", 24.1, {"epoch": 1, "step": 30}),
        ("worker_completed", 26.0, {"name": "worker-0-0", "index": 0}),
        ("job_done", 26.5, {"message": "committed progress is complete"}),
    ]
    # As the master writes them: JSON records, read back through the timeline's parser.
    return [
        from_record({"kind": kind, "t": T0 + t, **fields}, seq=i + 1)
        for i, (kind, t, fields) in enumerate(events)
    ]


def running(events: list[Event]) -> list[Event]:
    """``events`` with the times the master saw each worker Running (worker-1-1 ran from 11.5 s
    until the job's end)."""
    seen = [("worker-0-0", 0, 1.0), ("worker-1-0", 1, 2.0), ("worker-1-1", 1, 11.5)]
    more = [
        from_record({"kind": "worker_running", "t": T0 + t, "name": name, "index": index})
        for name, index, t in seen
    ]
    return sorted([*events, *more], key=lambda e: e.t)


def test_slot_seconds_per_tier_and_the_cost() -> None:
    summary = summarize(running(timeline()), prices=Prices(on_demand=3.6, spot=1.8))
    cost = summary.cost
    # min_workers 1: worker 0 guaranteed (1.0..26.0 s), the others opportunistic.
    assert cost.slot_seconds == {"guaranteed": 25.0, "opportunistic": 9.0 + 15.0}
    assert cost.cost == pytest.approx({"guaranteed": 0.025, "opportunistic": 0.012})
    # Measured at 2 workers: 15 steps in 4 s of commits; 30 steps on 2 slots take 16 s.
    assert (cost.steps_per_second, cost.throughput_measured) == (3.75, True)
    assert cost.fixed_cost == pytest.approx(0.016)
    metrics = summary.metrics()
    assert metrics["slot_seconds_guaranteed"] == 25.0
    assert metrics["cost"] == 0.037 and metrics["cost_saving"] == -0.021
    assert "cost" not in summarize(running(timeline())).metrics()  # no prices, no money
    assert summarize(timeline()).cost.slot_seconds["guaranteed"] == 0.0  # never seen Running


def test_summary_numbers() -> None:
    summary = summarize(timeline())
    assert (summary.steps, summary.final_loss, summary.restarts) == (30, 0.25, 2)
    assert summary.lost_steps > 0  # both new rounds came after the last commit
    assert summary.goodput == 30 / (30 + summary.lost_steps)
    assert (summary.workers_lost, summary.disruptions, summary.failures) == (1, 1, 0)
    assert (summary.epochs_done, summary.max_world_size, summary.final_world_size) == (2, 2, 2)
    assert summary.duration_s == 26.5 and summary.end_state == "succeeded"
    assert summary.world_size == ((0.0, 0), (5.0, 2), (12.0, 1), (20.0, 2), (26.5, 2))
    assert [step for step, _ in summary.losses] == list(range(1, 31))
    metrics = summary.metrics()
    assert set(metrics) >= {"final_loss", "steps", "restarts", "lost_steps", "goodput"}
    assert all(isinstance(v, int | float) for v in metrics.values())


def test_restarts_list_what_happened_since_the_previous_round() -> None:
    injected = [(T0 + 10.5, "preempt", "worker-1-0")]
    rows = summarize(timeline(), injected=injected).restart_rows
    assert [(r.round, r.world_before, r.world_after) for r in rows] == [(2, 2, 1), (3, 1, 2)]
    assert rows[0].causes == (
        "preempt worker-1-0 injected",
        "worker-1-0 lost (preempted)",
        "worker-1-1 launched",
    )
    assert rows[1].causes == ("(no worker event)",)


def test_an_empty_timeline_gives_zeros() -> None:
    assert summarize([]) == Summary()
    assert "no data" in render(Summary(), title="t", settings={})


def test_loss_lines_break_where_training_rolled_back() -> None:
    losses = [(1, 2.0), (2, 1.9), (3, 1.8), (2, 1.95), (3, 1.85), (4, 1.7)]
    assert loss_segments(losses) == [
        [(1.0, 2.0), (2.0, 1.9), (3.0, 1.8)],
        [(2.0, 1.95), (3.0, 1.85), (4.0, 1.7)],
    ]


def test_charts_are_well_formed_svg() -> None:
    chart = svg_chart(
        [[(0, 0), (5, 2), (12, 1)]],
        title="w",
        x_label="s",
        y_label="n",
        step=True,
        y_min=0,
        markers=[(11, "worker-1-0 <lost>", "#d33")],
    )
    root = ET.fromstring(chart)
    assert root.tag.endswith("svg")
    assert "worker-1-0 &lt;lost&gt;" in chart
    points = root.find("{http://www.w3.org/2000/svg}polyline").get("points").split()
    assert len(points) == 5  # 3 points + 2 corners of the step function


def test_report_has_charts_tables_and_escapes_text() -> None:
    events = timeline()
    events[6] = replace(events[6], message="<script>alert(1)</script>")
    prices = Prices(on_demand=3.6, spot=1.8)
    html = render(
        summarize(running(events), injected=[(T0 + 10.5, "preempt", "worker-1-0")], prices=prices),
        title="Elastic training r",
        settings={"run_id": "r"},
        injected=[(10.5, "preempt:worker-1@step10", "worker-1-0")],
        log_dir="/tmp/logs",
        prices=prices,
    )
    assert html.startswith("<!DOCTYPE html>") and "<script>" not in html
    assert len(re.findall(r"<svg ", html)) == 2
    for heading in (
        "Metrics",
        "What it costs",
        "World size over time",
        "Loss curve",
        "Restarts and their causes",
        "Workers lost",
        "Injected faults",
    ):
        assert f"<h2>{heading}</h2>" in html
    assert "2 → 1" in html and "Job succeeded" in html and "/tmp/logs" in html
    costs = html.split("<h2>What it costs</h2>")[1].split("<h2>")[0]
    assert "<td>opportunistic</td><td>0.0067</td><td>1.8000</td><td>0.0120</td>" in costs
    assert "fixed size: 2 workers, on-demand" in costs and "Saving" in costs
    for svg in re.findall(r"<svg .*?</svg>", html, re.S):
        ET.fromstring(svg)


def test_progress_lines() -> None:
    events = timeline()
    lines = [describe(e, T0) for e in events]
    assert lines[3] == "[    5.0s] round 1 formed: world size 2 (2 workers)"
    assert lines[5] == "[    9.0s] step 10 committed (epoch 0, world 2, loss 1.1000)"
    assert "worker-1-0 lost: preempted (terminated by SIGTERM)" in lines[6]
    assert lines[-1].endswith("job succeeded: committed progress is complete")
    assert describe(from_record({"kind": "unknown", "t": T0}), T0) is None


def test_a_failed_job_says_why_with_the_workers_errors() -> None:
    error = "RuntimeError: broken <on purpose> (rank 0, exit code 1); traceback tail: ..."
    events = [
        {"t": T0, "kind": "master_started"},
        {
            "t": T0 + 3,
            "kind": "worker_lost",
            "name": "worker-0-0",
            "cause": "failed",
            "failure": True,
            "message": f"exit code 1; worker error: {error}",
        },
        {"t": T0 + 4, "kind": "worker_lost", "name": "worker-1-0", "cause": "preempted"},
        {"t": T0 + 5, "kind": "job_failed", "message": f"2 worker failures ...: {error}"},
    ]
    html = render(summarize([from_record(e) for e in events]), title="t", settings={})
    why = html.split("<h2>Why it failed</h2>")[1].split("<h2>")[0]
    assert "2 worker failures" in why and "broken &lt;on purpose&gt;" in why
    assert "worker-0-0" in why and "worker-1-0" not in why  # only errors, not disruptions
    succeeded = render(summarize(timeline()), title="t", settings={})
    assert "Why it failed" not in succeeded


def test_a_spent_failure_budget_lists_every_counted_failure() -> None:
    """Failures restarted in place never end a worker: the summary counts them from the
    timeline's ``failure_counted`` events, and the report names where each happened."""
    nan = "NonFiniteLoss: non-finite loss (nan) at step 5 on rank 1 (rank 1, exit code 1)"
    events = [
        {"t": T0, "kind": "master_started"},
        {
            "t": T0 + 2,
            "kind": "failure_counted",
            "incident": "round-1-1f",
            "source": "agent",
            "worker": "worker-1-0",
            "node": "host-b",
            "rank": 1,
            "round": 1,
            "error": "RuntimeError: at step 3 (rank 1, exit code 1)",
            "count": 1,
        },
        {
            "t": T0 + 4,
            "kind": "failure_counted",
            "incident": "round-2-1f",
            "source": "agent",
            "worker": "worker-1-0",
            "node": "host-b",
            "rank": 1,
            "round": 2,
            "fatal": True,
            "error": nan,
            "count": 2,
        },
        {"t": T0 + 5, "kind": "job_failed", "message": f"worker-1-0: {nan}: ...", "failures": 2},
    ]
    summary = summarize([from_record(e) for e in events])
    assert summary.failures == summary.metrics()["worker_failures"] == 2
    assert summary.failure_rows[1] == (4.0, "worker-1-0", "node host-b, rank 1, round 2", nan)
    lines = [describe(from_record(e), T0) for e in events]
    assert lines[2] == f"[    4.0s] fatal failure 2 counted: worker-1-0: {nan}"
    why = render(summary, title="t", settings={}).split("<h2>Why it failed</h2>")[1]
    assert "node host-b, rank 1, round 1" in why and "RuntimeError: at step 3" in why
