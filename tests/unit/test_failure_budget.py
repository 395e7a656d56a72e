"""contract/failure_budget.py: the job's one failure budget (pure rules), its etcd records (real
etcd), and how an agent's verdict meets it (``peer_failures.after_budget``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kfp_elastic.contract.failure_budget import (
    FATAL_ERRORS,
    OWN_ACCOUNT_WAIT_S,
    SOURCE_AGENT,
    SOURCE_WORKER_END,
    CountedFailure,
    FailureBudget,
    agent_incident,
    better_account,
    is_fatal,
    read_failures,
    record_failure,
    worker_end_incident,
)
from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.rendezvous.peer_failures import (
    MembershipChange,
    RestartPolicy,
    Verdict,
    after_budget,
    is_fatal_failure,
    is_own_error,
)
from kfp_elastic.worker.finite_loss import NonFiniteLoss

NAN = "NonFiniteLoss: non-finite loss (nan) at step 7 on rank 1: training stopped"


def failure(incident: str, error: str = "RuntimeError: boom", **fields: Any) -> CountedFailure:
    return CountedFailure(
        **{"incident": incident, "source": SOURCE_AGENT, "error": error, **fields}
    )


# -- counting ---------------------------------------------------------------------------------
def test_max_failures_are_tolerated_and_one_more_spends_the_budget() -> None:
    budget = FailureBudget(2)
    for n in range(2):
        budget = budget.with_failure(failure(f"round-{n}-a"))
        assert budget.spent() is None
    budget = budget.with_failure(
        failure("round-5-a", worker="worker-1-0", node="host-1-x", rank=1, round=5)
    )
    assert budget.count == 3
    assert budget.spent() == (
        "3 worker failures exceed --max-failures=2; last: worker-1-0: RuntimeError: boom "
        "(node host-1-x, rank 1, round 5)"
    )


def test_a_budget_spent_by_a_peers_account_waits_for_the_failing_ranks_own() -> None:
    peer = failure(
        "round-3-a",
        "RuntimeError: Connection closed by peer",
        rank=0,
        own_error=False,
        peers_error=True,
    )
    budget = FailureBudget(0, (peer,))
    assert budget.exceeded
    assert budget.spent(waited_s=0.0) is None  # the failing rank's agent may still report
    assert budget.spent(waited_s=OWN_ACCOUNT_WAIT_S) is not None  # then: what it has
    # Once every worker has ended, no agent is left to report: at once.
    assert budget.spent(waited_s=0.0, workers_running=False) is not None
    own = failure("round-3-a", "RuntimeError: boom", rank=1)
    assert FailureBudget(0, (own,)).spent(waited_s=0.0) is not None  # the error itself: at once
    unknown = failure("round-3-a", "the worker wrote no error file", own_error=False)
    assert FailureBudget(0, (unknown,)).spent(waited_s=0.0) is not None  # no account to wait for
    fatal = failure("round-4-a", NAN, fatal=True, own_error=False, peers_error=True)
    assert FailureBudget(3, (fatal,)).spent(waited_s=0.0) is not None  # fatal: never waits


def test_zero_max_failures_tolerates_none() -> None:
    assert FailureBudget(0).spent() is None
    assert FailureBudget(0, (failure("round-1-a"),)).spent() is not None


def test_an_incident_is_counted_once_however_many_report_it() -> None:
    """Two agents of one round (one rank's error fails its peer too), or a master that
    re-reads a worker's end after a restart: one counted failure."""
    budget = FailureBudget(1, (failure("round-3-a", node="a"), failure("round-3-a", node="b")))
    assert budget.count == 1 and budget.failures[0].node == "a" and budget.spent() is None
    ended = failure(worker_end_incident("worker-0-0"), source=SOURCE_WORKER_END)
    assert budget.with_failure(ended).with_failure(ended).count == 2


def test_rounds_of_a_restarted_rendezvous_are_other_incidents() -> None:
    assert agent_incident(3, 0x1F) != agent_incident(3, 0x2F) != agent_incident(4, 0x1F)


def test_without_a_budget_only_a_fatal_failure_spends_it() -> None:
    many = FailureBudget(None, tuple(failure(f"round-{n}-a") for n in range(50)))
    assert many.spent() is None
    assert many.with_failure(failure("round-51-a", NAN, fatal=True)).spent() is not None


# -- fatal failures ---------------------------------------------------------------------------
def test_a_fatal_failure_spends_the_budget_at_its_first_occurrence() -> None:
    budget = FailureBudget(3, (failure("round-2-a", NAN, fatal=True, rank=1, round=2),))
    why = budget.spent()
    assert why is not None and NAN in why and "rank 1" in why
    assert "first occurrence (1 worker failure counted)" in why


def test_non_finite_loss_is_the_fatal_error() -> None:
    assert NonFiniteLoss.__name__ in FATAL_ERRORS
    error = NonFiniteLoss(float("nan"), 3, 1)
    assert is_fatal(f"{type(error).__name__}: {error}")  # how torchrun's error file says it
    assert not is_fatal("RuntimeError: non-finite loss mentioned in a message")
    assert not is_fatal("")


# -- free vs counted, and the agent's verdict ---------------------------------------------------
@dataclass
class Failure:  # what torchrun's ProcessFailure carries
    exitcode: int
    message: str
    timestamp: int = 0


def test_a_peer_loss_is_free_and_never_reaches_the_budget() -> None:
    spent = FailureBudget(0, (failure("round-1-a"),))
    verdict = RestartPolicy().decide(MembershipChange(lost=("b",)), "1:x", 0.0)
    assert verdict == Verdict.FREE and after_budget(verdict, spent) == Verdict.FREE


def test_a_counted_failure_restarts_in_place_until_the_budget_is_spent() -> None:
    policy = RestartPolicy(max_repeated_failures=0)
    budget = FailureBudget(1)
    verdicts = []
    for n in range(3):  # an error that moves: a new signature at every start
        local = policy.decide(None, f"1:RuntimeError: at step {n}", float(n))
        budget = budget.with_failure(failure(f"round-{n}-a"))
        verdicts.append(after_budget(local, budget))
    assert verdicts == [Verdict.COUNT, Verdict.GIVE_UP, Verdict.GIVE_UP]


def test_a_fatal_failure_is_never_restarted_in_place() -> None:
    local = RestartPolicy().decide(None, f"1:{NAN}", 0.0)
    assert local == Verdict.COUNT  # the first time: torchrun alone would restart it
    failures = {1: Failure(1, NAN), 0: Failure(1, "RuntimeError: Connection closed by peer")}
    assert is_fatal_failure(failures)
    budget = FailureBudget(3, (failure("round-1-a", NAN, fatal=True),))
    assert after_budget(local, budget) == Verdict.GIVE_UP


def test_the_root_cause_is_the_workers_own_error_not_a_peers() -> None:
    assert is_own_error({0: Failure(1, "RuntimeError: boom")})
    assert not is_own_error(
        {0: Failure(1, "RuntimeError: [pair.cc:534] Connection closed by peer")}
    )
    assert not is_own_error({0: Failure(-15, "To enable traceback see: https://...")})
    own, peers = failure("round-1-a"), failure("round-1-a", own_error=False)
    nan = failure("round-1-a", NAN, fatal=True)
    assert better_account(own, peers) and not better_account(peers, own)
    assert better_account(nan, own) and not better_account(own, own)


# -- the records in etcd ------------------------------------------------------------------------
def test_records_count_each_incident_once_and_keep_the_better_account(
    client: Any, run_id: str
) -> None:
    prefix = f"/kfp-elastic-test/{run_id}"
    peers = failure("round-4-1f", "RuntimeError: Connection closed by peer", own_error=False)
    assert record_failure(client, prefix, peers) is True
    assert record_failure(client, prefix, peers) is False  # the same incident: not again
    nan = failure("round-4-1f", NAN, fatal=True, node="b", rank=1, round=4)
    assert record_failure(client, prefix, nan) is False  # counted already, but the root cause
    assert record_failure(client, prefix, failure(worker_end_incident("worker-0-0"))) is True
    (first, second) = read_failures(client, prefix)
    assert (first.incident, first.error, first.rank, first.fatal) == ("round-4-1f", NAN, 1, True)
    assert first.t > 0 and second.incident == "ended-worker-0-0"
    assert FailureBudget(5, (first, second)).spent() is not None
    client.put(RunKeys(prefix).failure("unreadable"), "not json")
    assert read_failures(client, prefix)[-1].error == "not json"  # still counts


def test_a_free_failure_gives_a_counted_round_its_own_error_without_counting(
    client: Any, run_id: str
) -> None:
    prefix = f"/kfp-elastic-test/{run_id}"
    own = failure("round-3-1f", "RuntimeError: a data-dependent error", node="b", rank=1)
    # Nothing counted for the round: a failure judged free counts nothing.
    assert record_failure(client, prefix, own, count=False) is False
    assert read_failures(client, prefix) == ()
    # A peer counted the round with what it saw; the own error replaces it, one count.
    peers = failure(
        "round-3-1f", "RuntimeError: Connection closed by peer", own_error=False, peers_error=True
    )
    assert record_failure(client, prefix, peers) is True
    assert record_failure(client, prefix, own, count=False) is False
    (counted,) = read_failures(client, prefix)
    assert (counted.error, counted.rank, counted.peers_error) == (own.error, 1, False)
