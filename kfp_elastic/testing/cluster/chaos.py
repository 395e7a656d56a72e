"""Seeded chaos for one job on the test cluster: which disruptions, in which order, when.

:func:`plan_chaos` is the pure decision (a seed gives the same plan on every machine, so a failing
seed can be replayed): the kinds, and the committed step at which each event fires, spread over
the whole run (one drawn in each of ``count`` equal slots of [first step, 90 % of the run]).
:class:`ChaosExecutor` applies it to a running job (``training_run.TrainingRun``);
:func:`run_chaos` runs one job under a plan and checks it (completion, every event recovered,
exactly-once, accuracy against an undisturbed run, nothing left behind), for the chaos test
(``tests/e2e/test_chaos.py``) and ``python -m benchmarks chaos``.

The plan keeps the job able to finish: the cluster never has fewer nodes than the job's minimum
(so it always ends with enough for the minimum world), and a node is never the last event's
victim. Every kind appears at least once when the plan is long enough to hold them all.
"""

from __future__ import annotations

import enum
import logging
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kfp_elastic.master.timeline import Committed
from kfp_elastic.testing.cluster.training_run import undisturbed_accuracy
from kfp_elastic.testing.nodes import wait_for

if TYPE_CHECKING:
    from kfp_elastic.rendezvous.round_formation import RoundRecord
    from kfp_elastic.testing.cluster.training_run import TrainingRun
    from kfp_elastic.worker.progress import Committed

T = TypeVar("T")

log = logging.getLogger(__name__)


class ChaosKind(enum.Enum):
    PREEMPT_WORKER = "preempt_worker"  # a higher-priority pod takes one worker's node
    KILL_WORKER = "kill_worker"  # SIGKILL every process of one worker pod
    DELETE_MASTER = "delete_master"  # the master pod deleted, then created again (KFP retry)
    RESTART_ETCD = "restart_etcd"  # etcd stops and starts on the same data
    REMOVE_NODE = "remove_node"  # a node (and every pod on it) is gone at once
    ADD_CAPACITY = "add_capacity"  # a new node joins


@dataclass(frozen=True)
class ChaosEvent:
    index: int
    kind: ChaosKind
    # Which worker/node, as a choice among those present when the event fires (the executor
    # takes ``pick % len(candidates)``): the plan cannot know pod names in advance.
    pick: int
    # Fires once the job committed this step (and recovered from the previous event).
    at_step: int = 0


#: Events fire up to this fraction of the run: the last one leaves steps to recover in.
LAST_EVENT_FRACTION = 0.9


def plan_chaos(
    seed: int,
    count: int,
    nodes: int,
    min_nodes: int,
    total_steps: int,
    first_step: int = 1,
    kinds: tuple[ChaosKind, ...] = tuple(ChaosKind),
) -> list[ChaosEvent]:
    """``count`` events for a job of ``total_steps`` steps that needs ``min_nodes`` of the
    cluster's ``nodes`` nodes, the first at ``first_step`` or later."""
    if count < 0 or nodes < min_nodes or min_nodes < 1:
        raise ValueError(f"cannot plan {count} events for {nodes} nodes, minimum {min_nodes}")
    steps = event_steps(seed, count, first_step, int(total_steps * LAST_EVENT_FRACTION))
    rng = random.Random(seed)
    wanted = list(kinds)
    rng.shuffle(wanted)
    events: list[ChaosEvent] = []
    present = nodes
    for index in range(count):
        remaining = count - index
        allowed = [kind for kind in kinds if _allowed(kind, present, min_nodes, remaining)]
        # A node cannot be the last event's victim: when kinds are forced in, it goes first.
        unseen = sorted(
            (kind for kind in wanted if kind in allowed),
            key=lambda kind: kind is not ChaosKind.REMOVE_NODE,
        )
        # The last chances to show every kind (a node removal needs a later event after it).
        if unseen and len(wanted) + (ChaosKind.REMOVE_NODE in wanted) >= remaining:
            kind = unseen[0]
        else:
            kind = rng.choice(allowed)
        if kind in wanted:
            wanted.remove(kind)
        present += {ChaosKind.REMOVE_NODE: -1, ChaosKind.ADD_CAPACITY: 1}.get(kind, 0)
        pick = rng.randrange(1 << 16)
        events.append(ChaosEvent(index=index, kind=kind, pick=pick, at_step=steps[index]))
    return events


def event_steps(seed: int, count: int, first: int, last: int) -> list[int]:
    """``count`` committed steps spread over [``first``, ``last``], in order: one drawn in each
    of ``count`` equal slots, so chaos reaches every part of the run (slots narrower than a
    step share steps). Drawn apart from the kinds: a seed's kinds stay what they were."""
    if count and last < first:
        raise ValueError(
            f"a run whose events may fire up to step {last} cannot hold them from step {first}: "
            "train longer (more epochs) or plan fewer events"
        )
    rng = random.Random(f"chaos-steps-{seed}")
    width = (last - first + 1) / max(count, 1)
    return [min(last, first + int(width * (i + rng.random()))) for i in range(count)]


def _allowed(kind: ChaosKind, present: int, min_nodes: int, remaining: int) -> bool:
    if kind is ChaosKind.REMOVE_NODE:
        # Never below the minimum, and leave a later event to add capacity back if needed.
        return present - 1 >= min_nodes and remaining > 1
    return True


# -- applying a plan to a running job (I/O) ----------------------------------------------------

#: The disturbed run's final accuracy may differ from the undisturbed one's by this much.
ACCURACY_TOLERANCE = 0.01


@dataclass(frozen=True)
class ChaosOutcome:
    """One applied event: what it hit, what the executor waited for, and what it saw."""

    index: int
    kind: ChaosKind
    target: str
    at_step: int  # the planned step
    step: int  # the committed step when it fired
    world_before: int
    world_after: int  # the world of the first commit after it
    # event -> the first commit of a later step; for an event that took a member of the round,
    # of a step committed after the next round (without it) formed: the next world's first step
    recovery_s: float
    new_world: bool  # whether it took a member of the round (recovery waited for the next)
    members: tuple[str, ...]  # the round's participants it took (rendezvous node ids)
    expected: str  # what the executor waited for
    seen: str  # the job when the wait ended
    ok: bool  # whether the expected happened within the executor's timeout


@dataclass(frozen=True)
class Check:
    """One check of a chaos run: its name, whether it passed, and why (expected vs seen)."""

    name: str
    ok: bool
    detail: str


def recovery_by_kind(outcomes: list[ChaosOutcome]) -> dict[str, dict[str, float]]:
    """Per event kind (pure): how many recovered, and their median and max recovery seconds."""
    by_kind: dict[str, list[float]] = {}
    for outcome in outcomes:
        if outcome.ok:
            by_kind.setdefault(outcome.kind.value, []).append(outcome.recovery_s)
    return {
        kind: {
            "count": len(times),
            "median_s": round(statistics.median(times), 2),
            "max_s": round(max(times), 2),
        }
        for kind, times in sorted(by_kind.items())
    }


def events_check(plan: list[ChaosEvent], outcomes: list[ChaosOutcome]) -> Check:
    """Every planned event fired and the job recovered from each (pure)."""
    recovered = [o for o in outcomes if o.ok]
    problems = [
        f"event {o.index} {o.kind.value} {o.target} at step {o.step}: "
        f"expected {o.expected}; seen {o.seen}"
        for o in outcomes
        if not o.ok
    ]
    if not problems and len(outcomes) < len(plan):
        missing = plan[len(outcomes)]
        problems.append(
            f"event {missing.index} ({missing.kind.value} at step {missing.at_step}) and later "
            "never fired: the job ended first"
        )
    detail = f"{len(recovered)} of {len(plan)} events fired and recovered"
    return Check(
        "events", not problems and len(recovered) == len(plan), "; ".join([detail, *problems])
    )


class ChaosExecutor:
    """Applies a :func:`plan_chaos` plan to ``run`` (a :class:`TrainingRun` that trains).

    Each event fires once the job committed its planned step and a step after the previous
    event's, on the target ``pick % len(candidates)`` of the candidates sorted by name:
    running workers (preempt, kill), nodes (remove); the master pod, etcd and a new node are
    single targets. What it then waits for is what the event does to the job's rendezvous
    round, read from etcd just before it fires: an event that takes a participant of the round
    (its worker, or the node under it) ends that round, so it waits for a later round without
    that participant and a commit after it; any other (a worker that had not joined yet, etcd,
    the master, a node without a member) leaves the round as it was, so it waits for a commit
    of a later step. Node loss need not be instant: each wait is bounded by ``timeout_s``, and
    one that runs out is an outcome with ``ok=False`` (what was expected, what was seen), after
    which no further event fires. A serving pod that preempted a worker leaves once the worker
    is gone, and a master pod that is lost (deleted, or on a removed node) is run again as
    KFP's retry does. Logs ``event=chaos index=.. kind=.. target=..`` before each event.
    """

    def __init__(self, run: TrainingRun, node_capacity: dict[str, str], timeout_s: float = 120):
        self.run = run
        self.node_capacity = node_capacity  # what an added node holds
        self.timeout_s = timeout_s
        self.added = 0
        self.last_step = 0  # the committed step after the last event (apply goes on from it)

    def apply(self, plan: list[ChaosEvent]) -> list[ChaosOutcome]:
        """Fire ``plan``; the outcomes of the events fired (fewer when the job ended first or
        did not recover from one within the timeout)."""
        outcomes: list[ChaosOutcome] = []
        for event in plan:
            at_least = max(event.at_step, self.last_step + 1)
            moved = self._wait(
                lambda step=at_least: self._moved(step), f"step {at_least} before {event}"
            )
            before = self.run.committed()
            if before is not None and before.complete:
                log.info("event=chaos_stopped index=%d reason=job_complete", event.index)
                break
            round_before = self.run.round_record() if moved else None
            if before is None or round_before is None:
                outcomes.append(
                    self._stalled(event, f"a commit of step {at_least}", self.last_step)
                )
                break
            outcome = self._apply_one(event, before, round_before)
            outcomes.append(outcome)
            if not outcome.ok:
                break
            self.last_step = max(before.step, self.run.step())
        return outcomes

    def _apply_one(
        self, event: ChaosEvent, before: Committed, round_before: RoundRecord
    ) -> ChaosOutcome:
        workers = self.run.running_workers()
        target = self._target(event, workers)
        taken = self._taken(event.kind, target, workers)
        # Read before the event: a killed pod has no processes left to match.
        members = self.run.round_members(taken, round_before) if taken else ()
        fired = time.monotonic()
        log.info(
            "event=chaos index=%d kind=%s target=%s step=%d round=%d members=%s",
            event.index,
            event.kind.value,
            target,
            before.step,
            round_before.number,
            ",".join(members) or "-",
        )
        if members:
            expected = (
                f"a round after {round_before.number} without {len(members)} participant(s) "
                f"of {target}, then a commit"
            )
        else:
            expected = f"a commit of step {before.step + 1} (round {round_before.number} as it was)"
        try:
            self._act(event, target)
        except TimeoutError as exc:
            ok, expected = False, f"{expected} (the event itself: {exc})"
        else:
            if members:
                ok = self._wait(lambda: self._left(members), expected)
                formed_at = self.run.step()
                ok = ok and self._wait(lambda: self._moved(formed_at + 1, new_world=True), expected)
            else:
                ok = self._wait(lambda: self._moved(before.step + 1), expected)
        after = self.run.committed()
        outcome = ChaosOutcome(
            index=event.index,
            kind=event.kind,
            target=target,
            at_step=event.at_step,
            step=before.step,
            world_before=before.world_size,
            world_after=after.world_size if after else 0,
            recovery_s=round(time.monotonic() - fired, 2),
            new_world=bool(members),
            members=members,
            expected=expected,
            seen=self._seen(),
            ok=ok,
        )
        log.info(
            "event=chaos_%s index=%d kind=%s target=%s step=%d world=%d->%d recovery_s=%.2f "
            "new_world=%s",
            "recovered" if ok else "not_recovered",
            outcome.index,
            outcome.kind.value,
            outcome.target,
            outcome.step,
            outcome.world_before,
            outcome.world_after,
            outcome.recovery_s,
            outcome.new_world,
        )
        return outcome

    def _stalled(self, event: ChaosEvent, expected: str, step: int) -> ChaosOutcome:
        """The job did not reach the event's step: the event never fired."""
        seen = self._seen()
        log.info("event=chaos_stalled index=%d expected=%r seen=%r", event.index, expected, seen)
        return ChaosOutcome(
            index=event.index,
            kind=event.kind,
            target="-",
            at_step=event.at_step,
            step=step,
            world_before=0,
            world_after=0,
            recovery_s=0.0,
            new_world=False,
            members=(),
            expected=f"{expected} before the event",
            seen=seen,
            ok=False,
        )

    def _wait(self, predicate: Callable[[], bool], what: str) -> bool:
        """Whether ``predicate()`` came true within the timeout (a lost master run again)."""
        try:
            self.run.wait_until(predicate, self.timeout_s, what)
        except TimeoutError:
            return False
        return True

    def _moved(self, at_least: int, new_world: bool = False) -> bool:
        """A commit of step ``at_least`` or later (or the job complete); with ``new_world``,
        one the new world trained: not the state the old world's survivors saved as it broke
        (rescued) or its last step before a worker stopped."""
        record = self.run.committed()
        if record is None:
            return False
        if new_world and (record.rescued or record.stopping) and not record.complete:
            return False
        return record.step >= at_least or record.complete

    def _left(self, members: tuple[str, ...]) -> bool:
        """A round without ``members`` formed (or the job completed). Any such round is a later
        one (they were in the round before the event); its number says nothing: once the last
        agent left, the run lease expires with the round key and numbers start again."""
        record, committed = self.run.round_record(), self.run.committed()
        if committed is not None and committed.complete:
            return True
        return (
            record is not None
            and bool(record.participants)
            and not set(members) & set(record.participants)
        )

    def _seen(self) -> str:
        """The job now, for an outcome: its commit, round and worker pods."""
        record, current = self.run.committed(), self.run.round_record()
        commit = f"step {record.step} world {record.world_size}" if record else "no commit read"
        rounds = (
            f"round {current.number} of {len(current.participants)}"
            if current is not None
            else "etcd not answering"
        )
        try:
            pods = ", ".join(f"{k} {v}" for k, v in sorted(self.run.workers().items()))
        except Exception as exc:  # noqa: BLE001 - what was seen, as far as it can be read
            pods = repr(exc)
        return f"{commit}; {rounds}; worker pods: {pods or 'none'}"

    def _target(self, event: ChaosEvent, workers: dict[str, str]) -> str:
        kind = event.kind
        if kind in (ChaosKind.PREEMPT_WORKER, ChaosKind.KILL_WORKER):
            return choose_target(event, list(workers), "running workers")
        if kind is ChaosKind.REMOVE_NODE:
            return choose_target(event, self.run.nodes(), "nodes")
        if kind is ChaosKind.DELETE_MASTER:
            return self.run.master
        if kind is ChaosKind.RESTART_ETCD:
            return "etcd"
        return f"chaos-node-{self.added + 1}"

    @staticmethod
    def _taken(kind: ChaosKind, target: str, workers: dict[str, str]) -> list[str]:
        """The worker pods the event takes."""
        if kind in (ChaosKind.PREEMPT_WORKER, ChaosKind.KILL_WORKER):
            return [target]
        if kind is ChaosKind.REMOVE_NODE:
            return [pod for pod, node in workers.items() if node == target]
        return []

    def _act(self, event: ChaosEvent, target: str) -> None:
        run, kind = self.run, event.kind
        if kind is ChaosKind.PREEMPT_WORKER:
            # A burst of serving: it holds the node until the worker is gone, then leaves
            # (holding it longer could stall a job whose only worker it took).
            serving = run.preempt_worker(target)
            try:
                wait_for(lambda: run.phase(target) is None, self.timeout_s, 0.2, f"{target} gone")
            finally:
                run.release(serving)
        elif kind is ChaosKind.KILL_WORKER:
            run.kill_pod(target)
        elif kind is ChaosKind.REMOVE_NODE:
            run.cluster.remove_node(target)
        elif kind is ChaosKind.DELETE_MASTER:
            run.delete_master()
        elif kind is ChaosKind.RESTART_ETCD:
            run.restart_etcd()
        else:
            self.added += 1
            run.cluster.add_node(target, **self.node_capacity)


def choose_target(event: ChaosEvent, candidates: list[str], what: str) -> str:
    """The event's target among ``candidates`` (pure): sorted, so a seed replays the same."""
    if not candidates:
        raise AssertionError(f"chaos event {event}: no {what} to choose from")
    return sorted(candidates)[event.pick % len(candidates)]


# -- one job under chaos, checked ------------------------------------------------------------


@dataclass
class ChaosResult:
    """What :func:`run_chaos` saw: the plan, each event's outcome, and the checks."""

    seed: int
    plan: list[ChaosEvent] = field(default_factory=list)
    outcomes: list[ChaosOutcome] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    phase: str = ""  # the training task's pod at the end
    job_s: float = 0.0
    total_steps: int = 0
    base_world_size: int = 0
    accuracy: float | None = None
    undisturbed_accuracy: float | None = None
    master_retries: int = 0
    leftovers: dict[str, Any] = field(default_factory=dict)
    # The job's own numbers (its Metrics artifact: lost_steps, goodput, ...) beside what its
    # commits show (``commit_counts``), so a master retry's effect on them can be checked.
    metrics: dict[str, Any] = field(default_factory=dict)
    commits: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(check.ok for check in self.checks)

    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]


def run_chaos(
    run: TrainingRun,
    seed: int,
    events: int,
    node_capacity: dict[str, str],
    reference_root: Path,
    event_timeout_s: float = 120,
    done_timeout_s: float = 240,
    exit_handler: bool = False,
) -> ChaosResult:
    """Start ``run``'s job, fire a ``plan_chaos(seed, events, ...)`` plan spread over its steps
    (planned once the first commit tells the global batch, hence the run's length), and check
    it: ``events`` (each fired and recovered), ``completion`` (the training task succeeded),
    ``exactly_once``, ``accuracy`` (within ``ACCURACY_TOLERANCE`` of an undisturbed run of the
    same model definition, trained under ``reference_root`` beside the job once no etcd restart
    is left in the plan) and ``leftovers`` (no
    pod or process of the cluster left; after the exit handler's pod when ``exit_handler``).
    Every wait is bounded: a check that cannot pass fails with why, and the others still run.
    """
    result = ChaosResult(seed=seed)
    began = time.monotonic()
    run.start()
    started = _attempt(lambda: run.wait_committed(1, timeout=event_timeout_s, what="first commit"))
    if isinstance(started, str):
        result.checks.append(Check("events", False, f"no event fired: {started}"))
    else:
        result.total_steps = run.total_steps() or 0
        try:
            result.plan = plan_chaos(
                seed,
                events,
                nodes=len(run.nodes()),
                min_nodes=int(run.params["min_workers"]),
                total_steps=result.total_steps,
                first_step=started.step + 1,
            )
        except ValueError as exc:
            result.checks.append(Check("events", False, f"no plan: {exc}"))
    with ThreadPoolExecutor(1) as pool:
        reference = None
        if not isinstance(started, str):
            # The reference trains beside the job, against the same etcd: once no etcd restart
            # is left in the plan (it is to be undisturbed), and long before the job ends.
            restarts = [e.index for e in result.plan if e.kind is ChaosKind.RESTART_ETCD]
            split = restarts[-1] + 1 if restarts else 0
            executor = ChaosExecutor(run, node_capacity, event_timeout_s)
            result.outcomes = executor.apply(result.plan[:split])
            base_world = _attempt(run.base_world_size)
            result.base_world_size = base_world if isinstance(base_world, int) else 0
            reference = pool.submit(
                undisturbed_accuracy, reference_root, run, result.base_world_size
            )
            if len(result.outcomes) == split and all(o.ok for o in result.outcomes):
                result.outcomes += executor.apply(result.plan[split:])
            if result.plan:
                result.checks.append(events_check(result.plan, result.outcomes))
        phase = _attempt(lambda: run.wait_done(done_timeout_s))
        result.job_s = round(time.monotonic() - began, 1)
        if phase not in ("Succeeded", "Failed"):  # still running: the wait ran out
            phase = f"{_attempt(lambda: run.phase(run.master))} ({phase})"
        result.phase = phase
        calm = _attempt(reference.result) if reference is not None else "the job never committed"
    result.master_retries = run.retries
    succeeded = result.phase == "Succeeded"
    result.checks.append(
        Check("completion", succeeded, f"training task {result.phase} after {result.job_s} s")
    )
    if succeeded:
        once = _attempt(run.check_exactly_once)
        result.checks.append(
            Check(
                "exactly_once",
                once is None,
                "every sample of every epoch counted once; shard queues all done"
                if once is None
                else str(once)[:800],
            )
        )
        disturbed = _attempt(run.accuracy)
        result.accuracy = disturbed if isinstance(disturbed, float) else None
        metrics = _attempt(run.metrics)
        result.metrics = metrics if isinstance(metrics, dict) else {"error": metrics}
        timeline = _attempt(run.timeline)  # before the exit handler clears it
        if isinstance(timeline, list):
            result.commits = commit_counts([e for e in timeline if isinstance(e, Committed)])
    else:
        result.checks.append(Check("exactly_once", False, "no final model: the job did not end"))
    result.undisturbed_accuracy = calm if isinstance(calm, float) else None
    result.checks.append(accuracy_check(result.accuracy, result.undisturbed_accuracy, calm))
    if exit_handler:
        handled = _attempt(run.exit_handler)
        if isinstance(handled, str) and handled.startswith("error: "):
            log.info("event=chaos_exit_handler_failed error=%r", handled)
    gone = _attempt(run.wait_no_leftovers)
    left = _attempt(run.leftovers)
    result.leftovers = left if isinstance(left, dict) else {"error": left}
    result.checks.append(
        Check(
            "leftovers",
            gone is None,
            "no pod or process left" if gone is None else f"left: {result.leftovers}",
        )
    )
    return result


def commit_counts(commits: list[Committed]) -> dict[str, int]:
    """What a job's commits show, in the order they were made (pure): how many there were,
    the last step, and how many committed steps were taken back (a later commit at a lower step
    than one before it: a restore from an older snapshot)."""
    backwards = 0
    for before, after in zip(commits, commits[1:], strict=False):
        backwards += max(0, before.step - after.step)
    return {
        "commits": len(commits),
        "last_step": commits[-1].step if commits else 0,
        "steps_taken_back": backwards,
    }


def accuracy_check(disturbed: float | None, calm: float | None, why: object = None) -> Check:
    """The disturbed run's final accuracy within ``ACCURACY_TOLERANCE`` of the undisturbed
    one's (pure)."""
    if disturbed is None or calm is None:
        missing = "the job's model" if disturbed is None else f"the reference ({why})"
        return Check("accuracy", False, f"not measured: no accuracy of {missing}")
    diff = disturbed - calm
    return Check(
        "accuracy",
        abs(diff) <= ACCURACY_TOLERANCE,
        f"{disturbed:.4f} vs undisturbed {calm:.4f} (diff {diff:+.4f}, "
        f"allowed ±{ACCURACY_TOLERANCE})",
    )


def _attempt(action: Callable[[], T]) -> T | str:
    """``action()``, or ``"error: ..."`` when it raised: a check that fails, not a crash."""
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - recorded in the check it belongs to
        log.info("event=chaos_check_error error=%r", exc)
        return f"error: {type(exc).__name__}: {exc}"
