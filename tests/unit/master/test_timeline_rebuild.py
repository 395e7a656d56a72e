"""The timeline from the workers' own records (pure): a master that was away puts the same
rounds and commits on the timeline as one that never left, so lost steps, goodput and the
causes of worker ends do not depend on a master watching."""

from __future__ import annotations

from dataclasses import dataclass

from kfp_elastic.contract.worker_end import END_COMPLETED, END_ORPHANED, END_SIGTERM, WorkerEnd
from kfp_elastic.master.job import vanished_status
from kfp_elastic.master.metrics import TimelineStats
from kfp_elastic.master.observer import missed_events
from kfp_elastic.master.scaling import outcome_of
from kfp_elastic.master.timeline import Committed, Event, RoundFormed
from kfp_elastic.rendezvous.round_formation import NO_ROUND, RoundRecord
from kfp_elastic.worker import progress

T0 = 1_700_000_000.0


@dataclass
class Records:
    """What the rendezvous and rank 0 write: the round record and the committed record."""

    round: RoundRecord = NO_ROUND
    committed: progress.Committed | None = None

    def form(self, t: float, nodes: int) -> None:
        names = tuple(f"node-{i}" for i in range(nodes))
        self.round = self.round.followed_by(self.round.number + 1, names, 1, T0 + t)

    def commit(self, t: float, step: int, rescued: bool = False, stopping: bool = False) -> None:
        new = progress.Committed(
            step,
            0,
            step,
            world_size=len(self.round.participants),
            rescued=rescued,
            stopping=stopping,
            losses=(1.0 / step,),
        )
        self.committed = progress.recorded(self.committed, new, self.round.number, T0 + t)


def observe(records: Records, stats: TimelineStats, timeline: list[Event]) -> None:
    """One observation of the master: what it appends, folded as it appends it."""
    for event in missed_events(
        records.round, records.committed, stats.last_round, stats.last_commit, 1
    ):
        stats.add(event)
        timeline.append(event)


# (t, action, args): a kill (no rescue), a preemption (stopping commit), a restore from an
# older snapshot (the committed step goes back 3) and a survivors' rescue.
SCRIPT = [
    (0, "form", 2),
    (2, "commit", 4),
    (4, "commit", 8),
    (6, "commit", 12),
    (7, "form", 2),  # a worker killed 1 s after step 12 was committed: ~2 steps lost
    (9, "commit", 14),
    (11, "commit", 18),
    (12, "stop", 20),  # SIGTERM: every rank finished step 20 and it was committed
    (13, "form", 1),
    (15, "commit", 17),  # restored an older snapshot: 20 - 17 lost
    (17, "commit", 21),
    (18, "form", 2),
    (19, "rescue", 23),  # the survivors kept what they had trained: that round lost nothing
    (21, "commit", 27),
]


def play(observe_after: set[int]) -> tuple[TimelineStats, list[Event]]:
    records, stats, timeline = Records(), TimelineStats(), []
    for i, (t, action, arg) in enumerate(SCRIPT):
        if action == "form":
            records.form(t, arg)
        else:
            records.commit(t, arg, rescued=action == "rescue", stopping=action == "stop")
        if i in observe_after:
            observe(records, stats, timeline)
    observe(records, stats, timeline)
    return stats, timeline


def worker_view(timeline: list[Event]) -> list[tuple]:
    return [
        ("round", e.round, e.formed_at, e.world_size)
        if isinstance(e, RoundFormed)
        else ("commit", e.step, e.at, e.round, e.rescued, e.stopping)
        for e in timeline
        if isinstance(e, (RoundFormed, Committed))
    ]


def test_a_master_away_rebuilds_the_same_timeline_and_numbers() -> None:
    watched, watched_timeline = play(observe_after=set(range(len(SCRIPT))))
    # Away from just after step 8 to the end: one look at the records at its return.
    away, away_timeline = play(observe_after={0, 2})
    assert worker_view(away_timeline) == worker_view(watched_timeline)
    assert [e.step for e in away_timeline if isinstance(e, Committed)] == [
        4,
        8,
        12,
        14,
        18,
        20,
        17,
        21,
        23,
        27,
    ]
    assert [e.round for e in away_timeline if isinstance(e, RoundFormed)] == [1, 2, 3, 4]
    # 2 (the kill: 1 s at 2 steps/s) + 0 (stopped at a commit) + 3 (back from 20 to 17)
    # + 0 (rescued): exactly what the records show, with or without a master watching.
    for stats in (watched, away):
        assert (stats.lost_steps, stats.steps_total, stats.restarts) == (5, 27, 3)
        assert stats.goodput() == 27 / (27 + 5)


def test_rounds_and_commits_are_stamped_with_the_workers_times() -> None:
    _, timeline = play(observe_after={0})
    round_two = next(e for e in timeline if isinstance(e, RoundFormed) and e.round == 2)
    assert round_two.formed_at == T0 + 7
    commit_14 = next(e for e in timeline if isinstance(e, Committed) and e.step == 14)
    assert (commit_14.at, commit_14.round) == (T0 + 9, 2)


def test_the_records_stay_bounded() -> None:
    records = Records()
    for n in range(40):
        records.form(n, 2)
    for step in range(1, 200):
        records.commit(40 + step, step)
    assert records.committed is not None
    assert len(records.committed.recent) == progress.RECENT_COMMITS
    assert len(records.round.history) == 16
    # Both survive their JSON form.
    assert progress.Committed.from_json(records.committed.to_json()) == records.committed
    assert RoundRecord.from_json(records.round.to_json()) == records.round


def cause(end: WorkerEnd | None, error: dict | None = None) -> tuple[str, bool]:
    outcome = outcome_of(vanished_status("worker-1-0", {"index": 1, "attempt": 0}, end, error))
    return outcome.cause, outcome.failure


def test_a_worker_gone_while_no_master_watched_ends_as_it_recorded_or_unknown() -> None:
    assert cause(WorkerEnd(END_SIGTERM, T0, 20, 2)) == ("preempted", False)
    assert cause(WorkerEnd(END_COMPLETED, T0, 27, 4)) == ("completed", False)
    # Stopped by its own agent for want of a master (rendezvous/orphan.py): not a preemption.
    assert cause(WorkerEnd(END_ORPHANED, T0, 20, 2, "no master for 300 s")) == ("orphaned", False)
    gave_up = {"verdict": "give_up", "error": "RuntimeError: boom"}
    assert cause(None, gave_up) == ("failed", True)
    # An error its agent counted and restarted from says nothing of how the worker ended; no
    # pod status and no record: the cause is not invented.
    assert cause(None, {"verdict": "count", "error": "RuntimeError: boom"}) == ("unknown", False)
    assert cause(None) == ("unknown", False)
