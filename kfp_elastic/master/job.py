"""The master's control loop: keep one elastic job between MIN and MAX workers until it ends.

Every ``reconcile_interval_s`` (and at once on a launcher event or a watched etcd change) the
loop puts new rounds and commits on the timeline, asks ``master.scaling.decide`` what to do with
the workers, records ended workers (state + timeline) before deleting them, counts the failures
nobody counted yet in the job's failure budget and ends the job once it is spent
(``kfp_elastic/contract/failure_budget.py``), launches replacements and refreshes the metrics. All
state is in etcd (``master.state``): a master that is SIGKILLed and started again with the same
run id takes the leadership over, adopts the workers that still run and goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.failure_budget import (
    SOURCE_LAUNCH,
    SOURCE_WORKER_END,
    CountedFailure,
    FailureBudget,
    launch_incident,
    read_failures,
    record_failure,
    worker_end_incident,
)
from kfp_elastic.contract.prices import Prices
from kfp_elastic.contract.worker_end import END_COMPLETED, END_ORPHANED, WorkerEnd, read_end
from kfp_elastic.etcd.client import TRANSIENT_ERRORS, retry
from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.etcd.settings import DEFAULT_OUTAGE_WAIT_S
from kfp_elastic.job_spec import JobSpec
from kfp_elastic.master.cost import SlotUsage, cost_of
from kfp_elastic.master.ladder import LadderPolicy
from kfp_elastic.master.ladder_keeper import LadderKeeper
from kfp_elastic.master.launcher import (
    Launcher,
    LauncherForbidden,
    Reason,
    WorkerPhase,
    WorkerStatus,
)
from kfp_elastic.master.metrics import Metrics, TimelineStats
from kfp_elastic.master.observer import Observer
from kfp_elastic.master.preflight import DeferredCheck
from kfp_elastic.master.scaling import Decision, decide, is_active, replaced_worker
from kfp_elastic.master.state import (
    FINISHED_STATES,
    MasterState,
    NotLeaderError,
    start_refusal,
)
from kfp_elastic.master.timeline import (
    Event,
    FailureCounted,
    JobDone,
    JobFailed,
    LaunchFailed,
    MasterRecovered,
    MasterStarted,
    MasterSteppedDown,
    ModelDefChecked,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
    WorkerRunning,
    read_timeline,
)
from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE
from kfp_elastic.rendezvous.peer_failures import Verdict
from kfp_elastic.worker.progress import Committed, Progress

log = logging.getLogger(__name__)

REDELETE_S = 10.0


def non_finite_loss(committed: Committed | None) -> str | None:
    """Why a job whose last commit is ``committed`` must not count as succeeded: a NaN/inf
    loss among the steps it records (a script that never checks its loss), else None."""
    if committed is None:
        return None
    losses = tuple(committed.losses)
    for index, loss in enumerate(losses):
        if not math.isfinite(loss):
            step = committed.step - len(losses) + 1 + index
            return f"training loss is not finite ({loss}) at step {step}"
    return None


def vanished_status(
    name: str,
    record: Mapping[str, Any],
    end: WorkerEnd | None,
    error: Mapping[str, Any] | None = None,
) -> WorkerStatus:
    """A worker of the table that the launcher no longer lists: it ended while no master
    watched and its pod (process tree) is gone, status and all. Why, from what the worker
    recorded itself: its end (``contract/worker_end.py``), else its agent giving up on an error
    (``errors/{worker}`` with verdict ``give_up``); without either, unknown rather than a
    guess."""
    index, attempt = record.get("index"), record.get("attempt")
    reason, code = Reason.UNKNOWN, None
    message = "gone while no master watched, with no pod status and no record of its own"
    if end is not None:
        at = f"at step {end.step}, round {end.round} (its own record; its pod is gone)"
        if end.end == END_COMPLETED:
            reason, code, message = Reason.COMPLETED, 0, f"finished {at}"
        elif end.end == END_ORPHANED:
            reason, code = Reason.ORPHANED, ORPHANED_EXIT_CODE
            message = f"stopped itself, {end.message} {at}"
        else:  # the kubelet's notice: preemption, eviction or node shutdown (not told apart)
            reason, message = Reason.PREEMPTED, f"stopped on SIGTERM {at}"
    elif error is not None and error.get("verdict") == Verdict.GIVE_UP.value:
        reason = Reason.ERROR
        message = f"its agent gave up (its own record; its pod is gone): {error.get('error', '')}"
    return WorkerStatus(
        name,
        WorkerPhase.DELETED,
        reason,
        message,
        exit_code=code,
        worker_index=index,
        attempt=attempt,
    )


@dataclass(frozen=True)
class JobResult:
    state: str  # succeeded | failed | refused (the run id is taken) | stepped_down
    message: str
    failures: int = 0  # failures counted against the job's budget (failure_budget)

    @property
    def exit_code(self) -> int:
        return {"succeeded": 0, "failed": 1, "refused": 2}.get(self.state, 3)


LauncherFactory = Callable[[MasterState], Launcher]


class ElasticJob:
    """``run()`` blocks until the job succeeded, failed, or this master stepped down."""

    def __init__(
        self,
        spec: JobSpec,
        client: MultiEndpointEtcd3Client,
        make_launcher: LauncherFactory,
        *,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        origin: str | None = None,
        prices: Prices | None = None,
        prepare: Callable[[MasterState], DeferredCheck | None] | None = None,
    ) -> None:
        """``spec``: a validated job (``master/host.py`` validates it once per start).
        ``origin``: who starts the job, for telling a retry from a new job under a used run
        id (``master.state.start_refusal``): the KFP component passes its KFP run; None (the
        CLI) is never a retry. ``prices``: of the cost metrics (the host's plan resolved them);
        None: the job's, else the ConfigMap's variables. ``prepare``: called by ``run`` with the
        run's state once the run id may start, before the leadership is requested (the host's
        checks before any worker starts); what it raises ends ``run``; a ``DeferredCheck`` it
        returns runs on while the workers start, and its failure fails the job (the workers
        deleted)."""
        self.prices = spec.launch.kubernetes.prices(os.environ) if prices is None else prices
        self.spec = spec
        self.client = client
        self.make_launcher = make_launcher
        self.prepare = prepare
        self.state = MasterState(
            client,
            spec.run_prefix,
            lease_ttl=spec.policy.leader_ttl_s,
            origin=origin,
            outage_wait_s=spec.etcd.outage_wait if spec.etcd else DEFAULT_OUTAGE_WAIT_S,
        )
        self.metrics = Metrics()
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.launcher: Launcher | None = None
        self._stop = threading.Event()  # ends the loop
        self._stop_reason = ""
        self._cancel = False  # SIGINT: fail the job and stop the workers
        self._wake = threading.Event()
        self._events_stop = threading.Event()
        self._cache: dict[str, WorkerStatus] = {}
        self._cache_lock = threading.Lock()
        self._table: dict[str, dict[str, Any]] = {}
        self._deleted_at: dict[str, float] = {}
        # name -> the error its agent recorded ("" if none), and whether it recorded one (then
        # its failures are in the failure budget already)
        self._worker_errors: dict[str, tuple[str, bool]] = {}
        self._counted_on_timeline: set[str] = set()  # failure incidents with their event
        self._forbidden: LauncherForbidden | None = None  # the event watch was refused
        self._stats = TimelineStats()  # the observer's: the master's own events go in it too
        self._ladder: LadderKeeper | None = None  # a job with a ladder, on Kubernetes
        self._deferred: DeferredCheck | None = None  # the model definition's check, running

    # -- control from outside ----------------------------------------------------------------
    def request_stop(self, cancel: bool, reason: str = "SIGTERM") -> None:
        """``cancel``: fail the job and stop its workers; otherwise step down and leave them.
        ``reason``: what asked (SIGINT, SIGTERM, this master's pod being deleted), for the
        record."""
        if not self._stop.is_set():
            self._stop_reason = reason
        self._cancel = self._cancel or cancel
        self._stop.set()
        self._wake.set()

    # -- main ---------------------------------------------------------------------------------
    def refusal(self) -> str | None:
        """Why this job may not start under its run id, from what etcd holds now (None: it may):
        ``run`` asks first, before ``prepare`` (the checks that load the model)."""
        return self.state.refusal(self.spec.run_id, self._committed_step())

    def run(self) -> JobResult:
        try:
            # A master may start while etcd restarts (a retry after a crash of both): wait
            # it out, within the same bound as the leadership request.
            refusal = retry(self.refusal, self.state.outage_wait_s, "reading the run's state")
            if refusal:
                log.error("run id in use: %s", refusal)
                return JobResult("refused", refusal)
            if self.prepare is not None:
                self._deferred = self.prepare(self.state)
                if self._deferred is not None:
                    self._deferred.when_done(self._wake.set)  # a failure ends the job at once
            if not self.state.acquire(stop=self._stop, on_lost=self._wake.set):
                return JobResult("stepped_down", "stopped while waiting for the leadership")
            return self._run_as_leader()
        except NotLeaderError as error:
            log.error("stepping down: %s", error)
            return JobResult("stepped_down", str(error))
        finally:
            self._events_stop.set()
            if self.launcher is not None:
                self.launcher.close()
            self.metrics.close()
            self.state.release()

    def _committed_step(self) -> int | None:
        committed, _ = Progress(self.client, self.spec.run_prefix).committed_record()
        return None if committed is None else committed.step

    def _run_as_leader(self) -> JobResult:
        spec, state = self.spec, self.state
        status = state.status()
        # Again as the leader: the job may have ended while this master waited.
        refusal = start_refusal(spec.run_id, state.origin, status, None, self._committed_step())
        if refusal:
            log.error("run id in use: %s", refusal)
            return JobResult("refused", refusal)
        if status is not None and status.get("state") in FINISHED_STATES:  # a retry's
            log.info("run already finished run=%s state=%s", spec.run_id, status["state"])
            return JobResult(status["state"], status.get("message", ""))
        recovered = status is not None
        previous = state.spec()
        if recovered and previous is not None and previous != spec.to_record():
            changed = sorted(k for k in spec.to_record() if previous.get(k) != spec.to_record()[k])
            log.warning(
                "job spec differs from the stored one, using the new one fields=%s",
                ",".join(changed),
            )
        state.save_spec(spec.to_record())
        if not recovered:
            state.set_status("running")
        manifest = spec.manifest()
        size = spec.size
        timeline = read_timeline(self.client, spec.run_prefix)
        self._counted_on_timeline = {e.incident for e in timeline if isinstance(e, FailureCounted)}
        observer = Observer(
            self.client,
            state,
            spec.size.nproc_per_worker,
            TimelineStats(
                usage=SlotUsage(size.min_workers, size.max_workers, size.nproc_per_worker)
            ).add_all(timeline),
            self._wake.set,
        )
        self._stats = observer.stats
        if manifest is not None:
            stored = observer.progress.publish_manifest(manifest)
            if stored != manifest:
                log.warning("a different shard manifest is already published; keeping it")
        self._table = state.workers()
        self.launcher = self.make_launcher(state)
        ladder = LadderPolicy.from_settings(spec.launch.kubernetes)
        if ladder is not None and spec.launch.kind == "kubernetes":
            self._ladder = LadderKeeper(
                ladder,
                state,
                spec.run_id,
                spec.size.min_workers,
                spec.worker_pod_gpus(),
                self._append,
            )
            self._ladder.start(self.launcher, time.time())
        try:
            listed = {s.name: s for s in self.launcher.list_workers()}
        except LauncherForbidden as error:
            return self._finish("failed", str(error), observer)
        with self._cache_lock:
            self._cache.update(listed)
        for name, record in self._table.items():
            if not record.get("ended") and name not in listed:  # vanished while unwatched
                self._cache[name] = vanished_status(
                    name,
                    record,
                    read_end(self.client, spec.run_prefix, name),
                    self._error_record(name),
                )
        if self.metrics_port is not None:
            port = self.metrics.serve(self.metrics_port, self.metrics_host)
            log.info("metrics served url=http://%s:%d/metrics", self.metrics_host, port)
        live = sorted(n for n, r in self._table.items() if not r.get("ended"))
        if recovered:
            state.append_event(
                MasterRecovered(
                    master=state.identity,
                    workers=tuple(live),
                    failures=len(read_failures(self.client, spec.run_prefix)),
                )
            )
            log.info("master recovered run=%s adopted=%s", spec.run_id, ",".join(live) or "-")
        else:
            state.append_event(
                MasterStarted(
                    master=state.identity,
                    run_id=spec.run_id,
                    min_workers=spec.size.min_workers,
                    max_workers=spec.size.max_workers,
                    nproc_per_worker=spec.size.nproc_per_worker,
                    launcher=spec.launch.kind,
                )
            )
            log.info(
                "master started run=%s min=%d max=%d",
                spec.run_id,
                spec.size.min_workers,
                spec.size.max_workers,
            )
        observer.start()
        threading.Thread(target=self._consume_events, daemon=True, name="launcher-events").start()
        try:
            return self._loop(observer)
        finally:
            observer.stop()

    def _loop(self, observer: Observer) -> JobResult:
        spec, state = self.spec, self.state
        below_min_since: float | None = None
        finishing_since: float | None = None
        exceeded_since: float | None = None  # when the failure budget was first exceeded
        while True:
            if state.lost.is_set():
                raise NotLeaderError("leader lease lost")
            if self._stop.is_set():
                if self._cancel:
                    message = f"cancelled ({self._stop_reason})"
                    return self._finish("failed", message, observer)
                return self._step_down(self._stop_reason)
            try:
                if self._forbidden is not None:
                    raise self._forbidden
                if self._deferred is not None and self._deferred.done:
                    deferred, self._deferred = self._deferred, None
                    failure = deferred.failure()
                    state.append_event(
                        ModelDefChecked(
                            passed=failure is None,
                            seconds=round(deferred.seconds or 0.0, 3),
                            message=failure or "",
                        )
                    )
                    if failure:
                        return self._finish("failed", failure, observer)
                    log.info(
                        "model definition checked run=%s seconds=%.2f",
                        spec.run_id,
                        deferred.seconds or 0.0,
                    )
                observer.observe()
                now = time.monotonic()
                done = observer.complete or any(
                    r.get("ended") == "completed" for r in self._table.values()
                )
                workers = self._workers()
                decision = decide(
                    spec.scaling, workers, self._recorded(), below_min_since, now, finishing=done
                )
                self._record_ended(decision)
                below_min_since = decision.below_min_since
                if self._ladder is not None and not (done or decision.completed):
                    self._climb_ladder(decision, workers, now)
                budget = self._failure_budget()
                self._update_metrics(observer, workers, budget.count)
                exceeded_since = (exceeded_since or now) if budget.exceeded else None
                waited_s = now - exceeded_since if exceeded_since is not None else 0.0
                running = any(is_active(w) and w.phase != WorkerPhase.PENDING for w in workers)
                spent = (
                    None
                    if done or decision.completed
                    else budget.spent(waited_s, workers_running=running)
                )
                if spent:
                    return self._finish("failed", spent, observer)
                if decision.give_up:
                    return self._finish("failed", decision.give_up, observer)
                if done or decision.completed:
                    finishing_since = finishing_since or now
                    live = [  # Pending workers are deleted (decide): nothing to wait for
                        w
                        for w in workers
                        if is_active(w)
                        and w.phase != WorkerPhase.PENDING
                        and w.name not in {o.name for o in decision.ended}
                    ]
                    if not live or now - finishing_since >= spec.policy.finish_grace_s:
                        why = (
                            "committed progress is complete"
                            if observer.complete
                            else "a worker completed (exit code 0)"
                        )
                        if live:
                            why += "; " + self._lingering(live)
                        return self._finish("succeeded", why, observer)
                if not budget.exceeded:
                    # While the count waits for the failing rank's own account, nothing new
                    # starts: a replacement would join a round that fails again and counts.
                    self._launch(decision)
                self._delete(decision.delete, now)
            except LauncherForbidden as error:  # RBAC: no retry can help; say what to grant
                return self._finish("failed", str(error), observer)
            except TRANSIENT_ERRORS as error:  # etcd restarting: the leader lease decides
                log.warning("etcd unavailable, retrying in 1 s error=%r", error)
                self._wake.wait(1.0)
            self._wake.wait(spec.policy.reconcile_interval_s)
            self._wake.clear()

    def _step_down(self, reason: str) -> JobResult:
        """Hand the run over: record it, then release the leadership before anything else is
        closed. A master whose pod is deleted may have well under a second left (KFP's launcher
        dies on SIGTERM and the container ends with it: docs/master.md, "Signals")."""
        state = self.state
        try:
            state.append_event(MasterSteppedDown(master=state.identity, reason=reason))
        except TRANSIENT_ERRORS as error:  # the lease still goes: the next master need not wait
            log.warning("step-down not recorded (etcd unavailable) error=%r", error)
        state.release()
        log.warning(
            "stepped down run=%s master=%s reason=%s: workers left running for the next master",
            self.spec.run_id,
            state.identity,
            reason,
        )
        return JobResult("stepped_down", f"asked to stop ({reason}); workers left running")

    def _lingering(self, live: list[WorkerStatus]) -> str:
        """What to say of workers still running ``finish_grace_s`` after the job completed (a
        script that hangs at its end): they are ended, and the job is still a success."""
        where = {}
        for worker in live:
            pid = self._table.get(worker.name, {}).get("pid", "?")
            where[worker.name] = f"{worker.name} (node {worker.node or '?'}, pid {pid})"
        log.warning(
            "workers did not exit %.0fs after the job completed; ending them run=%s workers=%s",
            self.spec.policy.finish_grace_s,
            self.spec.run_id,
            ",".join(where.values()),
        )
        return (
            f"ended worker(s) {', '.join(where.values())} that did not exit within "
            f"finish_grace_s={self.spec.policy.finish_grace_s:g}s of the job's completion"
        )

    # -- workers ------------------------------------------------------------------------------
    def _consume_events(self) -> None:
        assert self.launcher is not None
        while not self._events_stop.is_set():
            try:
                for event in self.launcher.events(self._events_stop):
                    with self._cache_lock:
                        self._cache[event.name] = event
                    self._wake.set()
            except LauncherForbidden as error:  # the loop fails the job with it
                self._forbidden = error
                self._wake.set()
                return
            except Exception:  # noqa: BLE001 - keep watching; the loop still reconciles
                log.exception("launcher events failed; watching again in 1 s")
                self._events_stop.wait(1.0)

    def _recorded(self) -> set[str]:
        return {name for name, record in self._table.items() if record.get("ended")}

    def _workers(self) -> list[WorkerStatus]:
        """Statuses of the table's workers (and of unknown ones the launcher reports)."""
        with self._cache_lock:
            cache = dict(self._cache)
        recorded = self._recorded()
        workers = []
        for name, status in cache.items():
            if name not in self._table and status.worker_index is not None:
                self._table[name] = self.state.update_worker(
                    name,
                    index=status.worker_index,
                    attempt=status.attempt or 0,
                    launched_at=time.time(),
                )
                log.info(
                    "worker found name=%s index=%s (not launched by this master)",
                    name,
                    status.worker_index,
                )
            if status.phase == WorkerPhase.RUNNING:
                self._record_running(name, status)
            if not (name in recorded and status.phase == WorkerPhase.DELETED):
                workers.append(self._with_worker_error(status, recorded))
        for name, record in self._table.items():
            if name not in cache and name not in recorded:  # launched, not reported yet
                workers.append(
                    WorkerStatus(
                        name,
                        WorkerPhase.PENDING,
                        worker_index=record.get("index"),
                        attempt=record.get("attempt"),
                    )
                )
        return workers

    def _record_running(self, name: str, status: WorkerStatus) -> None:
        """The first time any master sees a worker Running: it holds a slot from now on
        (``master.cost``). Once per worker: the table's ``running_at`` survives a new master."""
        record = self._table.get(name)
        if record is None or record.get("running_at") or record.get("ended"):
            return
        self._table[name] = self.state.update_worker(name, running_at=time.time())
        self._append(WorkerRunning(name=name, index=status.worker_index))

    def _append(self, event: Event) -> None:
        """Put a worker event on the timeline and in the metrics' fold."""
        self._stats.add(self.state.append_event(event))

    def _with_worker_error(self, status: WorkerStatus, recorded: set[str]) -> WorkerStatus:
        """A worker that ended with an error, with the error its agent left in etcd
        (``RunKeys.worker_error``), for the job's result, timeline and report."""
        if status.reason != Reason.ERROR or status.name in recorded:
            return status
        error, _ = self._agent_error(status.name)
        if not error:
            return status
        return replace(status, message=f"{status.message}; worker error: {error}")

    def _agent_error(self, name: str) -> tuple[str, bool]:
        """(the error worker ``name``'s agent recorded, whether it recorded one: then it counted
        its failures in the budget itself)."""
        if name not in self._worker_errors:
            record = self._error_record(name)
            self._worker_errors[name] = (
                str((record or {}).get("error", "")),
                record is not None,
            )
        return self._worker_errors[name]

    def _failure_budget(self) -> FailureBudget:
        """The job's counted failures (``failure_budget``); those new to the timeline go on it."""
        failures = read_failures(self.client, self.spec.run_prefix)
        for count, failure in enumerate(failures, start=1):
            if failure.incident in self._counted_on_timeline:
                continue
            self._counted_on_timeline.add(failure.incident)
            self._append(
                FailureCounted(
                    incident=failure.incident,
                    source=failure.source,
                    worker=failure.worker,
                    node=failure.node,
                    rank=failure.rank,
                    round=failure.round,
                    fatal=failure.fatal,
                    error=failure.error,
                    count=count,
                )
            )
            log.warning(
                "failure counted run=%s count=%d max_failures=%d %s",
                self.spec.run_id,
                count,
                self.spec.policy.max_failures,
                failure.describe(),
            )
        return FailureBudget(self.spec.policy.max_failures, failures)

    def _count(self, failure: CountedFailure) -> None:
        try:
            record_failure(self.client, self.spec.run_prefix, failure)
        except TRANSIENT_ERRORS:
            raise
        except Exception as error:  # noqa: BLE001 - the worker's end is recorded regardless
            log.error("failure not counted run=%s error=%r", self.spec.run_id, error)

    def _error_record(self, name: str) -> dict[str, Any] | None:
        """What the worker's agent recorded of its last counted error (``RunKeys.worker_error``;
        None: nothing, or not readable)."""
        value, _ = self.client.get(RunKeys(self.spec.run_prefix).worker_error(name))
        try:
            record = json.loads(value) if value else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def _record_ended(self, decision: Decision) -> None:
        for outcome in decision.ended:
            if outcome.failure and not self._agent_error(outcome.name)[1]:
                # Its agent counted nothing (it died with its pod, or never started): count it.
                self._count(
                    CountedFailure(
                        incident=worker_end_incident(outcome.name),
                        source=SOURCE_WORKER_END,
                        error=outcome.message,
                        worker=outcome.name,
                    )
                )
            self._table[outcome.name] = self.state.update_worker(
                outcome.name,
                ended=outcome.cause,
                ended_at=time.time(),
                exit_code=outcome.exit_code,
                message=outcome.message,
            )
            worker = {
                "name": outcome.name,
                "index": outcome.worker_index,
                "exit_code": outcome.exit_code,
            }
            if outcome.completed:
                self._append(WorkerCompleted(**worker))
            else:
                self._append(
                    WorkerLost(
                        cause=outcome.cause,
                        failure=outcome.failure,
                        message=outcome.message,
                        **worker,
                    )
                )
            log.info(
                "worker %s name=%s index=%s cause=%s failure=%s message=%s",
                "completed" if outcome.completed else "lost",
                outcome.name,
                outcome.worker_index,
                outcome.cause,
                outcome.failure,
                outcome.message,
            )

    def _launch(self, decision: Decision) -> None:
        if not decision.launch:
            return
        self._reopen_rendezvous()
        with self._cache_lock:
            statuses = dict(self._cache)
        for index in decision.launch:
            before = replaced_worker(index, self._table, statuses)
            try:
                handle = self.launcher.launch(index)  # type: ignore[union-attr]
            except (NotLeaderError, LauncherForbidden):
                raise
            except Exception as error:  # noqa: BLE001 - counted; the budget ends a loop of these
                self._count(
                    CountedFailure(
                        incident=launch_incident(index, time.time()),
                        source=SOURCE_LAUNCH,
                        error=f"launch of worker {index} failed: {error}",
                    )
                )
                self.state.append_event(LaunchFailed(index=index, message=str(error)))
                log.error("worker launch failed index=%d error=%s", index, error)
                break
            # The level its pod was created at (a guaranteed slot on a ladder): what a move
            # re-creates (master/ladder_keeper.py).
            level = (
                {"level": self._ladder.level}
                if self._ladder is not None and index < self.spec.size.min_workers
                else {}
            )
            self._table[handle.name] = self.state.update_worker(
                handle.name, index=index, attempt=handle.attempt, launched_at=time.time(), **level
            )
            old, cause = before or ("", "")
            self._append(
                WorkerLaunched(
                    name=handle.name,
                    index=index,
                    attempt=handle.attempt,
                    replaces=old,
                    replaces_cause=cause,
                )
            )
            log.info(
                "worker launched name=%s index=%d attempt=%d replaces=%s cause=%s",
                handle.name,
                index,
                handle.attempt,
                old or "-",
                cause or "-",
            )

    def _climb_ladder(self, decision: Decision, workers: list[WorkerStatus], now: float) -> None:
        """The ladder's step (``master/ladder_keeper.py``): a move, then the guaranteed
        workers still in another level's class deleted gracefully (SIGTERM: a snapshot first);
        ``decide`` replaces them in their slots, in the level's class."""
        assert self._ladder is not None
        since = decision.below_min_since
        wall = time.time()
        moving = self._ladder.reconcile(
            self.launcher,  # type: ignore[arg-type]
            self._ladder.attained_gpu_s(self._stats.usage.slot_seconds(at=wall)),
            0.0 if since is None else now - since,
            wall,
            workers,
            self._table,
        )
        for name in moving:
            if name not in self._deleted_at:
                log.info(
                    "ladder re-creates worker name=%s level=%d class=%s",
                    name,
                    self._ladder.level,
                    self._ladder.priority_class,
                )
        self._delete(moving, now)

    def _delete(self, names: tuple[str, ...], now: float) -> None:
        """Ask the launcher once per name (again after ``REDELETE_S`` if it is still listed)."""
        for name in names:
            if now - self._deleted_at.get(name, -REDELETE_S) >= REDELETE_S:
                self._deleted_at[name] = now
                self.launcher.delete(name)  # type: ignore[union-attr]

    def _reopen_rendezvous(self) -> None:
        """torchrun closes the run when an agent gives up; a replacement could never join."""
        closed = RunKeys(self.spec.run_prefix).closed
        if self.client.get(closed)[0] is not None:
            self.client.delete(closed)
            log.warning("rendezvous reopened run=%s (an agent had closed it)", self.spec.run_id)

    # -- end ----------------------------------------------------------------------------------
    def _finish(self, result: str, message: str, observer: Observer) -> JobResult:
        spec, state = self.spec, self.state
        diverged = non_finite_loss(observer.committed) if result == "succeeded" else None
        if diverged:
            result, message = "failed", f"{diverged}: the model is not usable ({message})"
        log.log(
            logging.INFO if result == "succeeded" else logging.ERROR,
            "job %s run=%s message=%s",
            result,
            spec.run_id,
            message,
        )
        state.set_status(result, message)
        self._stop_workers()
        assert self.launcher is not None
        self.launcher.job_ended()
        observer.observe()
        end = JobDone if result == "succeeded" else JobFailed
        failures = len(read_failures(self.client, spec.run_prefix))
        state.append_event(end(message=message, failures=failures))
        return JobResult(result, message, failures)

    def _stop_workers(self, timeout_s: float = 30.0) -> None:
        """Delete every worker (ended ones too, so no pod lingers) and wait until none runs."""
        assert self.launcher is not None
        deadline = time.monotonic() + timeout_s
        try:
            listed = self.launcher.list_workers()
            for status in listed:
                self.launcher.delete(status.name)
            while time.monotonic() < deadline and any(not s.ended for s in listed):
                time.sleep(0.2)
                listed = self.launcher.list_workers()
        except LauncherForbidden as error:  # said already; the workers are left running
            log.error("cannot stop the workers run=%s error=%s", self.spec.run_id, error)
            return
        for name, record in list(self._table.items()):
            if not record.get("ended"):
                self._table[name] = self.state.update_worker(
                    name, ended="deleted", ended_at=time.time()
                )

    def _update_metrics(
        self, observer: Observer, workers: list[WorkerStatus], failures: int
    ) -> None:
        phases: dict[str, int] = {}
        for status in workers:
            if status.phase != WorkerPhase.DELETED:
                phases[status.phase.value] = phases.get(status.phase.value, 0) + 1
        stats = observer.stats
        self.metrics.update(
            world_size=observer.world_size(),
            workers=phases,
            restarts=stats.restarts,
            shard_queue=observer.shard_queues(),
            committed_step=stats.steps_total,
            steps_per_second=round(stats.rate(at=time.time()), 3),
            lost_steps=stats.lost_steps,
            failures=failures,
            cost=cost_of(stats.usage, self.prices, at=time.time()),
            ladder_level=None if self._ladder is None else self._ladder.level,
            attained_gpu_seconds=0.0 if self._ladder is None else round(self._ladder.attained, 3),
        )
