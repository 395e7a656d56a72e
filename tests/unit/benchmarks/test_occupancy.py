"""Slot occupancy: who holds a slot (bound, not terminated), integration of samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.scheduling.occupancy import (
    OccupancySampler,
    Sample,
    held_by,
    plot_slots,
    slot_seconds,
    utilization,
)
from kfp_elastic.master.pod_spec_checks import COMPONENT_LABEL, RUN_ID_LABEL


def pod(labels: dict[str, str], node: str | None, phase: str = "Running") -> dict[str, Any]:
    spec = {"nodeName": node} if node else {}
    return {"metadata": {"labels": labels}, "spec": spec, "status": {"phase": phase}}


def worker(run: str, node: str | None, phase: str = "Running") -> dict[str, Any]:
    return pod({COMPONENT_LABEL: "worker", RUN_ID_LABEL: run}, node, phase)


def test_bound_pods_hold_slots_until_they_terminate() -> None:
    pods = [
        worker("a", "n1"),
        worker("a", "n1", "Pending"),  # bound, starting: holds its slot
        worker("a", None, "Pending"),  # not bound: holds nothing
        worker("b", "n2", "Succeeded"),
        worker("b", "n2", "Failed"),
        worker("b", "n2"),
        pod({"app": "serving"}, "n3"),
        pod({COMPONENT_LABEL: "master", RUN_ID_LABEL: "a"}, "n3"),  # a master holds no slot
        pod({}, "n3"),
    ]
    assert held_by(pods) == {"a": 2, "b": 1, "serving": 1}


def test_samples_integrate_as_a_step_function() -> None:
    samples = [Sample(0.0, {"a": 2}), Sample(10.0, {"a": 2, "b": 2}), Sample(20.0, {"b": 4})]
    assert slot_seconds(samples, 0, 30) == 2 * 10 + 4 * 10 + 4 * 10
    assert slot_seconds(samples, 5, 15, owners=["b"]) == 2 * 5
    assert utilization(samples, 4, 10, 30) == 1.0
    assert utilization(samples, 4, 0, 10) == 0.5
    with pytest.raises(ValueError, match="end > start"):
        utilization(samples, 4, 10, 10)


def test_sampler_lists_until_stopped_and_counts_failed_listings() -> None:
    calls = iter([[worker("a", "n1")], RuntimeError("api down")])

    def listing() -> list[dict[str, Any]]:
        item = next(calls, [worker("a", "n1"), worker("b", "n1")])
        if isinstance(item, Exception):
            raise item
        return item

    sampler = OccupancySampler(listing, interval_s=0.01)
    with sampler:
        while len(sampler.samples) < 3:
            sampler._stop.wait(0.01)
    assert sampler.samples[0].held == {"a": 1}
    assert sampler.samples[-1].held == {"a": 1, "b": 1}
    assert sampler.errors == 1


def test_plot_writes_a_png(tmp_path: Path) -> None:
    samples = [Sample(0.0, {"a": 4}), Sample(5.0, {"a": 4, "b": 2})]
    out = plot_slots(
        {"gang": samples, "elastic": samples},
        6,
        tmp_path / "fig.png",
        "two jobs",
        labels={"a": "job A"},
        marks={"gang": [(5.0, "B submitted")]},
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
