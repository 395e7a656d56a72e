"""Who holds a cluster's slots over time, as the scheduling experiments on the test cluster
measure and draw it.

A *slot* is what one worker pod takes (one GPU in production; a unit of a node's capacity on
the test cluster). A pod holds its slot from the moment it is bound to a node
(``spec.nodeName``) until it has terminated or is gone: a pod that is still starting, or one
that was told to stop and is writing its snapshot, keeps the room from anyone else.

:func:`held_by` is the pure count over one listing of pods; :class:`OccupancySampler` lists the
pods every ``interval_s`` from a thread; :func:`utilization` and :func:`slot_seconds` integrate
the samples (a step function: each sample holds until the next); :func:`plot_slots` draws
stacked slot counts per owner, one panel per policy (matplotlib).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_elastic.master.pod_spec_checks import COMPONENT_LABEL, RUN_ID_LABEL

TERMINATED = ("Succeeded", "Failed")
SERVING_LABEL = "app"  # a serving pod's owner: its app label (a Deployment's selector)


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the experiment's start
    held: Mapping[str, int]  # owner -> slots held at t (owners holding none are left out)


def owner_of(pod: Mapping[str, Any]) -> str | None:
    """Whose slot a pod holds: a training job's run id for its worker pods, the ``app`` label
    for anything else that has one (serving); None for pods that hold no slot (a master, a
    KFP task)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(COMPONENT_LABEL) == "worker" and RUN_ID_LABEL in labels:
        return str(labels[RUN_ID_LABEL])
    if COMPONENT_LABEL in labels:
        return None
    app = labels.get(SERVING_LABEL)
    return str(app) if app else None


def holds_slot(pod: Mapping[str, Any]) -> bool:
    """Bound to a node and not terminated."""
    bound = bool((pod.get("spec") or {}).get("nodeName"))
    phase = (pod.get("status") or {}).get("phase")
    return bound and phase not in TERMINATED


def held_by(
    pods: Iterable[Mapping[str, Any]],
    owner: Callable[[Mapping[str, Any]], str | None] = owner_of,
) -> dict[str, int]:
    """Slots held per owner in one listing of pods (one slot per pod)."""
    held: dict[str, int] = {}
    for pod in pods:
        who = owner(pod)
        if who is not None and holds_slot(pod):
            held[who] = held.get(who, 0) + 1
    return held


def slot_seconds(
    samples: Sequence[Sample], start: float, end: float, owners: Iterable[str] | None = None
) -> float:
    """Slot-seconds held between ``start`` and ``end`` by ``owners`` (all when None): each
    sample's counts hold until the next sample (the last one until ``end``)."""
    wanted = None if owners is None else set(owners)
    total = 0.0
    for i, sample in enumerate(samples):
        until = samples[i + 1].t if i + 1 < len(samples) else end
        lo, hi = max(sample.t, start), min(until, end)
        if hi <= lo:
            continue
        count = sum(n for who, n in sample.held.items() if wanted is None or who in wanted)
        total += count * (hi - lo)
    return total


def utilization(
    samples: Sequence[Sample],
    slots: int,
    start: float,
    end: float,
    owners: Iterable[str] | None = None,
) -> float:
    """Busy slot-seconds over all slot-seconds between ``start`` and ``end``."""
    if end <= start or slots <= 0:
        raise ValueError(
            f"need end > start and slots > 0 (start={start}, end={end}, slots={slots})"
        )
    return slot_seconds(samples, start, end, owners) / (slots * (end - start))


@dataclass
class OccupancySampler:
    """Lists the pods every ``interval_s`` (``list_pods``: the API server's pods of the
    experiment's namespace) and keeps :class:`Sample` s; ``with`` starts and stops it."""

    list_pods: Callable[[], Iterable[Mapping[str, Any]]]
    interval_s: float = 0.2
    owner: Callable[[Mapping[str, Any]], str | None] = owner_of
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0  # listings that failed (the sample is skipped)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="occupancy")
        self.t0 = time.monotonic()

    def __enter__(self) -> OccupancySampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def now(self) -> float:
        """Seconds since the sampler started (the samples' clock)."""
        return time.monotonic() - self.t0

    def sample_once(self) -> None:
        t = self.now()
        try:
            pods = list(self.list_pods())
        except Exception:  # noqa: BLE001 - a failed listing is a gap, counted, not an end
            self.errors += 1
            return
        self.samples.append(Sample(t, held_by(pods, self.owner)))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(10)
            self.sample_once()  # the state at the end


def plot_slots(
    panels: Mapping[str, Sequence[Sample]],
    slots: int,
    path: Path,
    title: str,
    labels: Mapping[str, str] | None = None,
    marks: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> Path:
    """Stacked slots per owner over time, one panel per entry of ``panels`` (top to bottom,
    e.g. gang above elastic), the cluster's size as a dashed line; ``labels`` names owners in
    the legend, ``marks`` adds labelled vertical lines per panel (a submission, a scale event).
    Writes a PNG and returns its path."""
    from benchmarks.scheduling.figures import pyplot, save

    plt = pyplot()

    names = labels or {}
    owners = sorted({who for samples in panels.values() for s in samples for who in s.held})
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True)
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (panel, samples) in zip(axes, panels.items(), strict=True):
        times = [s.t for s in samples]
        stacks = [[s.held.get(who, 0) for s in samples] for who in owners]
        if samples:
            ax.stackplot(
                times, stacks, labels=[names.get(w, w) for w in owners], step="post", alpha=0.8
            )
        ax.axhline(slots, color="black", linestyle="--", linewidth=0.8)
        for t, text in (marks or {}).get(panel, ()):
            ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(text, (t, slots), fontsize=7, rotation=90, va="top", ha="right")
        ax.set_ylim(0, slots + 0.5)
        ax.set_ylabel("slots")
        ax.set_title(panel, fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)
