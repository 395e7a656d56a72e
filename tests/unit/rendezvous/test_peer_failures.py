"""When a worker failure restarts for free, counts, or makes the agent give up (pure rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kfp_elastic.rendezvous.peer_failures import (
    ERROR_TEXT_MAX_CHARS,
    MembershipChange,
    RestartPolicy,
    Verdict,
    error_text,
    failure_signature,
    membership_change,
)
from kfp_elastic.rendezvous.round_formation import NodeRecord, RoundRecord

ROUND = RoundRecord(4, ("a", "b", "c"))
LEASES = {"a": 1, "b": 2, "c": 3}


def node(name: str, lease: int, waiting: bool = False, after_round: int = 0) -> NodeRecord:
    return NodeRecord(name, 0, waiting, after_round, lease=lease)


def running() -> list[NodeRecord]:
    return [node(n, lease) for n, lease in LEASES.items()]


def test_no_change_while_every_participant_runs() -> None:
    assert membership_change(running(), ROUND, LEASES) == MembershipChange()


def test_a_participant_whose_record_is_gone_is_lost() -> None:
    live = [n for n in running() if n.node_id != "c"]
    assert membership_change(live, ROUND, LEASES) == MembershipChange(lost=("c",))


def test_a_participant_with_a_new_lease_lost_its_old_one() -> None:
    live = [*running()[:2], node("c", 30, waiting=True, after_round=4)]
    assert membership_change(live, ROUND, LEASES).lost == ("c",)


def test_a_participant_that_re_rounds_after_its_own_worker_failed_is_no_loss() -> None:
    live = [*running()[:2], node("c", 3, waiting=True, after_round=4)]
    change = membership_change(live, ROUND, LEASES)
    assert change == MembershipChange(restarting=("c",)) and not change.peer_lost


def test_newcomers_are_no_loss() -> None:
    live = [*running(), node("d", 4, waiting=True, after_round=4)]
    assert membership_change(live, ROUND, LEASES) == MembershipChange(newcomers=("d",))


def test_unknown_leases_judge_by_presence_only() -> None:
    live = [*running()[:2], node("c", 30)]
    assert membership_change(live, ROUND, {}) == MembershipChange()


LOST = MembershipChange(lost=("c",))
RE_ROUND = MembershipChange(restarting=("c",))


def test_a_failure_after_a_peer_died_is_free() -> None:
    policy = RestartPolicy()
    assert policy.decide(LOST, "1:RuntimeError: gloo", 0.0) == Verdict.FREE
    assert policy.counted == 0


@pytest.mark.parametrize("change", [None, MembershipChange(), RE_ROUND])
def test_a_failure_without_a_loss_counts(change: MembershipChange | None) -> None:
    assert RestartPolicy().decide(change, "1:boom", 0.0) == Verdict.COUNT


def test_the_same_failure_again_gives_up() -> None:
    # The storm: every node's failure re-rounds the others; none of them is a loss.
    policy = RestartPolicy(max_repeated_failures=2)
    assert policy.decide(RE_ROUND, "1:RuntimeError: broken", 0.0) == Verdict.COUNT
    assert policy.decide(RE_ROUND, "1:RuntimeError: broken", 1.0) == Verdict.GIVE_UP
    assert (policy.repeats, policy.counted) == (2, 2)


def test_a_different_failure_starts_a_new_streak() -> None:
    policy = RestartPolicy(max_repeated_failures=2)
    assert policy.decide(None, "1:a", 0.0) == Verdict.COUNT
    assert policy.decide(None, "1:b", 1.0) == Verdict.COUNT
    assert policy.decide(LOST, "1:gloo", 2.0) == Verdict.FREE  # free: neither counts nor resets
    assert policy.decide(None, "1:b", 3.0) == Verdict.GIVE_UP


def test_zero_repeated_failures_never_gives_up_early() -> None:
    policy = RestartPolicy(max_repeated_failures=0)
    assert {policy.decide(None, "1:a", float(t)) for t in range(20)} == {Verdict.COUNT}


def test_free_restarts_are_bounded_per_window() -> None:
    policy = RestartPolicy(max_free_restarts=2, free_restart_window_s=60.0)
    verdicts = [policy.decide(LOST, "1:gloo", t) for t in (0.0, 1.0, 2.0)]
    assert verdicts == [Verdict.FREE, Verdict.FREE, Verdict.COUNT]
    assert policy.decide(LOST, "1:gloo", 60.5) == Verdict.FREE  # the first one left the window


@dataclass
class Failure:  # the attributes of torch's ProcessFailure that the rules read
    exitcode: int
    message: str
    timestamp: int = 0
    error_file_data: dict[str, Any] = field(default_factory=dict)


def recorded(text: str, stack: str, exitcode: int = 1, timestamp: int = 0) -> Failure:
    data = {"message": {"message": text, "extraInfo": {"py_callstack": stack, "timestamp": "0"}}}
    return Failure(exitcode, text, timestamp, data)


def test_the_signature_ignores_ranks_and_pids() -> None:
    one = {0: recorded("RuntimeError: broken", "x"), 1: recorded("RuntimeError: broken", "y")}
    two = {3: recorded("RuntimeError: broken", "z")}
    assert failure_signature(one) == failure_signature(two) == "1:RuntimeError: broken"
    assert failure_signature({0: recorded("RuntimeError: other", "")}) != failure_signature(two)
    generic = Failure(1, "To enable traceback see: https://pytorch.org/docs/...")
    assert failure_signature({0: generic}) == "1:"


def test_error_text_has_the_error_and_the_traceback_tail() -> None:
    stack = "Traceback (most recent call last):\n" + "".join(
        f'  File "m.py", line {i}, in f{i}\n' for i in range(20)
    )
    stack += "RuntimeError: broken\n"
    text = error_text(
        {1: recorded("RuntimeError: broken", stack, timestamp=5), 0: Failure(-15, "")}
    )
    assert text.startswith("RuntimeError: broken (rank 1, exit code 1); traceback tail: ")
    assert "line 19, in f19 | RuntimeError: broken" in text and "line 10," not in text
    assert text.endswith("; 2 ranks failed")


def test_error_text_is_bounded() -> None:
    text = error_text({0: recorded("ValueError: " + "x" * 10_000, "")})
    assert len(text) <= ERROR_TEXT_MAX_CHARS + 10 and "ValueError: xxx" in text


def test_error_text_without_an_error_file() -> None:
    text = error_text({0: Failure(2, "To enable traceback see: ...")})
    assert text == "the worker wrote no error file (rank 0, exit code 2)"
