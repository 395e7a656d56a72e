"""Which priority level a job's guaranteed workers belong to: the least-attained-service ladder, a
pure decision, no I/O.

A ladder is a list of PriorityClasses for workers ``0 .. min_workers-1``, level 0 (the highest)
first, and thresholds of *attained service*: the GPU-seconds the job has had so far. As in
Tiresias (NSDI'19, its discretized least-attained-service queues), a job starts at level 0 and
moves down as its service grows, so that jobs with little GPU time, most of them short, preempt
the guaranteed workers of jobs that had much; a job that waits too long at a lower level goes
back up. The policy, as :func:`decide_level` applies it on each call:

- **Service** is the job's attained GPU-seconds (``master/cost.py`` measures slot-seconds; times
  GPUs per worker pod) minus what it had when it last entered level 0
  (:attr:`LadderState.service_base_gpu_s`: 0 at the start, its attained service when it was
  promoted), so a promoted job earns its way down again instead of falling back at once.
- **Demotion.** Threshold ``k`` is the service at which a job leaves level ``k``: the level due is
  the number of thresholds its service has reached, never above its present level and never
  below the last (a job that passed two thresholds since its last move, held back by the rate
  limit, moves down both at once). A job below ``min_workers`` is not demoted: it is waiting,
  not being served (Tiresias demotes running jobs only).
- **Starvation.** A job below level 0 that has been below ``min_workers`` for at least
  ``starvation_s`` (the caller's below-MIN clock, ``scaling.Decision.below_min_since``) goes
  back to level 0, and its service counts from there (Tiresias' starvation rule, with a fixed
  wait where Tiresias uses a multiple of the job's service). It comes first: a starving job is
  not demoted.
- **Rate limit.** Two moves of one job are at least ``min_move_interval_s`` apart: a move
  re-creates the job's guaranteed workers (a pod's priority is fixed when it is created), one
  membership change each. A due move held back is reported (:attr:`LadderAction.RATE_LIMITED`)
  and made by the first call after the interval. Start a job with :meth:`LadderState.start`,
  so its first move also waits an interval after its pods were created. With
  ``min_move_interval_s <= starvation_s`` (the contract insists) the limit never holds back a
  starvation promotion: the job has been below MIN, so not demoted, for longer than the interval,
  and it can only be below level 0 again after a demotion.

Opportunistic workers (``min_workers .. max_workers-1``) are not on the ladder: they keep the
opportunistic class, below every level; serving pods stay above every level.
:func:`check_priority_values` checks a ladder's PriorityClass values against both.

The master and the simulator both have what it takes: the job's attained GPU-seconds, how long
it has been below MIN, a clock; they keep the returned :class:`LadderState` for the next call.
The master keeps it in etcd (``MasterKeys.ladder``: a new master goes on from it, on the wall
clock) and, after a move, re-creates the guaranteed workers still in another level's class
(:func:`workers_to_move`): all of them at once, each deleted gracefully (SIGTERM: the job
commits a snapshot first, 0 steps lost) and replaced in its slot by ``master/scaling.py`` with
the new class, so the job goes through one shrink and one growth per move, not one per worker.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from kfp_elastic.job_spec import (
    DEFAULT_LADDER_MIN_MOVE_INTERVAL_S,
    DEFAULT_LADDER_PRIORITY_CLASSES,
    DEFAULT_LADDER_STARVATION_S,
    DEFAULT_LADDER_THRESHOLDS_GPU_H,
    KubernetesSettings,
)

#: The priority of a pod without a PriorityClass, as serving workloads usually run: every level
#: stays below it, so serving pods preempt any worker.
DEFAULT_POD_PRIORITY = 0


class LadderAction(enum.Enum):
    """What :func:`decide_level` found (the way torch's dynamic rendezvous names its actions)."""

    STAY = "stay"  # nothing due
    DEMOTE = "demote"  # its service reached its level's threshold: down now
    PROMOTE_STARVED = "promote_starved"  # below MIN for starvation_s: back to level 0 now
    RATE_LIMITED = "rate_limited"  # a move is due, the last one was too recent: later


@dataclass(frozen=True)
class LadderPolicy:
    """A ladder: ``priority_classes`` by level (level 0 first), ``thresholds_gpu_s[k]`` the
    service at which a job leaves level ``k`` (one fewer than the levels, increasing),
    ``starvation_s`` and ``min_move_interval_s`` as the module says. The defaults are the
    contract's (``job_spec.DEFAULT_LADDER_*``, which says why). ``ValueError`` for a ladder that
    cannot work."""

    priority_classes: tuple[str, ...] = DEFAULT_LADDER_PRIORITY_CLASSES
    thresholds_gpu_s: tuple[float, ...] = tuple(h * 3600.0 for h in DEFAULT_LADDER_THRESHOLDS_GPU_H)
    starvation_s: float = DEFAULT_LADDER_STARVATION_S
    min_move_interval_s: float = DEFAULT_LADDER_MIN_MOVE_INTERVAL_S

    def __post_init__(self) -> None:
        levels, thresholds = self.priority_classes, self.thresholds_gpu_s
        if len(levels) < 2 or len(set(levels)) != len(levels) or not all(levels):
            raise ValueError(f"a ladder needs two levels or more, each its own class: {levels}")
        if len(thresholds) != len(levels) - 1:
            raise ValueError(
                f"{len(levels)} levels need {len(levels) - 1} thresholds, got {thresholds}"
            )
        if thresholds[0] <= 0 or any(a >= b for a, b in pairwise(thresholds)):
            raise ValueError(f"thresholds must be positive and increasing, got {thresholds}")
        if self.starvation_s <= 0 or not 0 <= self.min_move_interval_s <= self.starvation_s:
            raise ValueError(
                "need 0 <= min_move_interval_s <= starvation_s and starvation_s > 0, got "
                f"{self.min_move_interval_s:g} and {self.starvation_s:g}"
            )

    @classmethod
    def from_settings(cls, k8s: KubernetesSettings) -> LadderPolicy | None:
        """The ladder a job's settings describe (None: the job has none); the settings are the
        ones ``JobSpec.validate`` accepted."""
        levels = k8s.ladder_levels()
        if not levels:
            return None
        return cls(
            levels,
            k8s.ladder_thresholds_gpu_s(),
            k8s.ladder_starvation_s,
            k8s.ladder_min_move_interval_s,
        )

    @property
    def last_level(self) -> int:
        return len(self.priority_classes) - 1

    def level_for(self, service_gpu_s: float) -> int:
        """The level of a job with this much service since it entered level 0: how many
        thresholds it has reached."""
        return bisect.bisect_right(self.thresholds_gpu_s, service_gpu_s)

    def priority_class(self, level: int) -> str:
        return self.priority_classes[level]


@dataclass(frozen=True)
class LadderState:
    """What the caller keeps for a job between calls (``decide_level`` returns the next one)."""

    level: int = 0
    last_move_at: float | None = None  # the caller's clock at the last move (or the start)
    service_base_gpu_s: float = 0.0  # attained GPU-seconds when the job last entered level 0

    @classmethod
    def start(cls, now: float) -> LadderState:
        """A job whose guaranteed workers were just created at level 0."""
        return cls(0, now, 0.0)

    def to_record(self) -> dict[str, float | int | None]:
        """Its JSON form (what the master stores in etcd)."""
        return {
            "level": self.level,
            "last_move_at": self.last_move_at,
            "service_base_gpu_s": self.service_base_gpu_s,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object], last_level: int) -> LadderState:
        """A stored state back; a level beyond ``last_level`` (a ladder shortened since) is the
        last level. ``ValueError`` for a record that is not one."""
        try:
            level = int(record["level"])  # type: ignore[call-overload]
            moved = record.get("last_move_at")
            base = float(record.get("service_base_gpu_s") or 0.0)  # type: ignore[arg-type]
            last_move_at = None if moved is None else float(moved)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a ladder state: {dict(record)!r}") from error
        return cls(min(max(level, 0), last_level), last_move_at, base)


@dataclass(frozen=True)
class LevelDecision:
    level: int  # the level the job's guaranteed workers belong to from now on
    move: bool  # True: re-create them in policy.priority_class(level) now
    action: LadderAction
    reason: str  # for the log: what was due and why
    state: LadderState  # to pass to the next call
    due_level: int  # what the rules ask for (the level, unless RATE_LIMITED)
    service_gpu_s: float  # attained since the job entered level 0
    next_threshold_gpu_s: float | None  # the service at which it leaves its level; None: last
    move_allowed_at: float | None  # RATE_LIMITED: the first time the due move may be made

    @property
    def service_to_demotion_gpu_s(self) -> float | None:
        """GPU-seconds more service before its next demotion is due (None: last level), so that
        an event-driven caller knows when to call again."""
        if self.next_threshold_gpu_s is None:
            return None
        return max(0.0, self.next_threshold_gpu_s - self.service_gpu_s)


def decide_level(
    policy: LadderPolicy,
    state: LadderState,
    attained_gpu_s: float,
    below_min_for_s: float,
    now: float,
) -> LevelDecision:
    """One step of the ladder for one job. ``attained_gpu_s``: its GPU-seconds so far (all
    its workers, both tiers); ``below_min_for_s``: how long fewer than ``min_workers`` of its
    workers have been Running (0: not below MIN); ``now``: the caller's clock, the one of
    ``state.last_move_at``."""
    if not 0 <= state.level <= policy.last_level:
        raise ValueError(f"level {state.level} is not on a ladder of levels 0..{policy.last_level}")
    service = max(0.0, attained_gpu_s - state.service_base_gpu_s)
    level = state.level
    if level > 0 and below_min_for_s >= policy.starvation_s:
        due, action = 0, LadderAction.PROMOTE_STARVED
        why = (
            f"below min_workers for {below_min_for_s:.0f}s (starvation_s "
            f"{policy.starvation_s:g}): back to level 0"
        )
    elif below_min_for_s > 0:
        due, action = level, LadderAction.STAY
        why = f"below min_workers for {below_min_for_s:.0f}s: waiting, not demoted"
    else:
        due = max(level, policy.level_for(service))  # at most the last level: one threshold each
        action = LadderAction.DEMOTE if due > level else LadderAction.STAY
        why = (
            f"{service / 3600:.2f} GPU-hours of service reached "
            f"{policy.thresholds_gpu_s[due - 1] / 3600:g}: level {level} -> {due}"
            if due > level
            else f"{service / 3600:.2f} GPU-hours of service at level {level}"
        )
    allowed_at = None
    if due != level and state.last_move_at is not None:
        allowed_at = state.last_move_at + policy.min_move_interval_s
        if now < allowed_at:
            action = LadderAction.RATE_LIMITED
            why += (
                f", held back: the last move was {now - state.last_move_at:.0f}s ago "
                f"(min_move_interval_s {policy.min_move_interval_s:g})"
            )
        else:
            allowed_at = None
    if action in (LadderAction.STAY, LadderAction.RATE_LIMITED):
        new_state = state
    elif action == LadderAction.PROMOTE_STARVED:
        new_state = LadderState(0, now, attained_gpu_s)
        service = 0.0
    else:
        new_state = LadderState(due, now, state.service_base_gpu_s)
    at = new_state.level
    return LevelDecision(
        level=at,
        move=at != level,
        action=action,
        reason=why,
        state=new_state,
        due_level=due,
        service_gpu_s=service,
        next_threshold_gpu_s=policy.thresholds_gpu_s[at] if at < policy.last_level else None,
        move_allowed_at=allowed_at,
    )


@dataclass(frozen=True)
class GuaranteedWorker:
    """What :func:`workers_to_move` needs of one live worker: its slot and the level its pod
    was created at (None: unknown, e.g. a pod no master of this run recorded)."""

    name: str
    worker_index: int
    level: int | None


def workers_to_move(
    workers: Sequence[GuaranteedWorker], level: int, min_workers: int
) -> tuple[str, ...]:
    """The live workers to re-create after the job moved to ``level``: those in a guaranteed
    slot (``0 .. min_workers-1``) whose pod was created at another level, in slot order. A pod
    of an unknown level is left alone: its class cannot be told, and it is replaced at the
    current level whenever it ends."""
    return tuple(
        w.name
        for w in sorted(workers, key=lambda w: w.worker_index)
        if w.worker_index < min_workers and w.level is not None and w.level != level
    )


def check_priority_values(
    policy: LadderPolicy,
    values: Mapping[str, int],
    opportunistic_class: str,
    serving_value: int = DEFAULT_POD_PRIORITY,
) -> None:
    """Whether the ladder's PriorityClasses can work in a cluster whose classes have ``values``
    (name -> value, as ``kubectl get priorityclass`` lists them): every level's class exists,
    each level's value is above the next one's (else a job at a higher level could not preempt
    a lower level's guaranteed workers), every level is below ``serving_value`` (serving pods
    preempt every worker) and above ``opportunistic_class``'s value (every guaranteed worker
    may preempt opportunistic ones, and those never preempt a guaranteed one). ``ValueError``
    naming the level, its class and the values at fault."""
    missing = [c for c in (*policy.priority_classes, opportunistic_class) if c not in values]
    if missing:
        raise ValueError(
            f"no PriorityClass {', '.join(repr(c) for c in missing)} in the cluster: apply "
            "manifests/base (or create them) before a job uses the ladder"
        )
    named = [f"level {i} ({c!r}, {values[c]})" for i, c in enumerate(policy.priority_classes)]
    levels = [values[c] for c in policy.priority_classes]
    for i, (higher, lower) in enumerate(pairwise(levels)):
        if higher <= lower:
            raise ValueError(
                f"{named[i]} must be above {named[i + 1]}: a job at level {i} could not "
                f"preempt level {i + 1}'s guaranteed workers"
            )
    if levels[0] >= serving_value:
        raise ValueError(
            f"{named[0]} must be below serving ({serving_value}): serving pods could not "
            "preempt its workers"
        )
    opportunistic = values[opportunistic_class]
    if levels[-1] <= opportunistic:
        raise ValueError(
            f"{named[-1]} must be above the opportunistic class ({opportunistic_class!r}, "
            f"{opportunistic}): its guaranteed workers could not preempt opportunistic ones"
        )
