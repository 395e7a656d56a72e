"""The job's one failure budget: what counts against ``max_failures``, where it is counted, and
when the job fails. Pure rules (:class:`FailureBudget`, :func:`is_fatal`, the incident names)
and the two etcd calls at the edge (:func:`record_failure`, :func:`read_failures`).

**What counts** (one *counted failure* each):

- a worker failure an agent saw and did not find free (``rendezvous/peer_failures.py``): once
  per rendezvous round, however many nodes saw it (one rank's error makes its peers' workers
  fail in the same round, and their agents see no loss: everybody re-rounds), whether the agent
  then restarts its workers in place (torchrun's ``--max-restarts``) or gives up;
- a worker (pod or process tree) that ended with an error its agent did not count (the agent
  itself died: an OOM-killed pod, a crashed torchrun), once per worker;
- a worker launch the launcher refused.

**What is free**: preemptions, evictions, lost nodes, workers deleted by someone else or
stopped without a master (orphaned), a failure caused by a peer's death or leave, and anything
that ends once the job is complete.

**Where**: one key per counted failure, ``{run}/failures/{incident}``
(``RunKeys.failure``), created once (a transaction puts it only while it is absent), no lease.
The count is the number of keys: in-place restarts, replaced pods and processes, a new master
(a KFP retry) all read and add to the same count, and a failure two agents (or a master that
restarted) report twice is counted once.

**When the job fails** (:meth:`FailureBudget.spent`):

- more than ``max_failures`` counted failures: it is how many the job tolerates (0: none);
- a *fatal* failure, at its first occurrence whatever the count: an error no restart can fix
  (:data:`FATAL_ERRORS`: ``NonFiniteLoss``, a NaN/inf loss under ``--nan-policy fail``,
  ``worker/finite_loss.py``; restored, the model only diverges again).

The agent that counts a failure which spends the budget stops restarting its workers (its
torchrun fails); the master ends the job (when the failure that spent it is a peer's
account, a connection the failing rank closed, once the failing rank's agent has replaced it
with the error itself, every worker has ended, or :data:`OWN_ACCOUNT_WAIT_S` passed), stops
every worker, and its result
names the count and the last failure (error, worker, node, rank, round); the timeline gets one
``failure_counted`` event per counted failure.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import RunKeys

#: Errors no restart can fix (the exception's class name, as torchrun's error file starts the
#: failure's message with it): the first one fails the job.
FATAL_ERRORS = ("NonFiniteLoss",)
#: ``CountedFailure.source``: an agent counted its workers' failure; the master counted a
#: worker that ended with an error its agent did not count; a launch failed.
SOURCE_AGENT, SOURCE_WORKER_END, SOURCE_LAUNCH = "agent", "worker_end", "launch"


def is_fatal(error: str) -> bool:
    """Whether ``error`` (a failure's error line, ``"Name: message"``) is one of
    :data:`FATAL_ERRORS`."""
    name = error.split(":", 1)[0].strip() if ":" in error else ""
    return name.rsplit(".", 1)[-1] in FATAL_ERRORS


def agent_incident(round_number: int, run_lease: int) -> str:
    """A failure of the workers of one rendezvous round: every agent of that round names it so.
    The run lease tells apart rounds of the same number after the rendezvous started over."""
    return f"round-{round_number}-{run_lease:x}"


def worker_end_incident(worker: str) -> str:
    """Worker ``worker`` (the master's name: one per pod or process tree) ended with an error."""
    return f"ended-{worker}"


def launch_incident(index: int, at: float) -> str:
    """A launch of worker slot ``index`` failed at unix time ``at``."""
    return f"launch-{index}-{int(at * 1000)}"


@dataclass(frozen=True)
class CountedFailure:
    """One failure counted against the budget, as stored in ``{run}/failures/{incident}``."""

    incident: str
    source: str  # SOURCE_*
    error: str  # what went wrong: error line, rank, exit code, traceback tail (bounded)
    worker: str = ""  # the master's worker name, or the agent's node id without a master
    node: str = ""  # the agent's node id
    rank: int | None = None  # the global rank whose error it is
    round: int | None = None
    fatal: bool = False
    # The error is the worker's own, not what its rank saw of a peer's failure (a collective
    # whose peer went away) nor a signal without an error file: the better account of a round.
    own_error: bool = True
    # The error is a peer's failure as this rank saw it in a collective (a connection the
    # failing rank closed): the failing rank's own agent has the error itself.
    peers_error: bool = False
    t: float = 0.0  # unix time of the writer

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, incident: str, text: bytes | str) -> CountedFailure:
        """Never raises: a record this reader cannot parse still counts (its text as error)."""
        try:
            data = json.loads(text)
            return cls(
                incident=incident,
                source=str(data.get("source", "")),
                error=str(data.get("error", "")),
                worker=str(data.get("worker", "")),
                node=str(data.get("node", "")),
                rank=None if data.get("rank") is None else int(data["rank"]),
                round=None if data.get("round") is None else int(data["round"]),
                fatal=bool(data.get("fatal", False)),
                own_error=bool(data.get("own_error", True)),
                peers_error=bool(data.get("peers_error", False)),
                t=float(data.get("t", 0.0)),
            )
        except (ValueError, TypeError, AttributeError):
            raw = text.decode(errors="replace") if isinstance(text, bytes) else text
            return cls(incident=incident, source="", error=raw[:200])

    def where(self) -> str:
        """``node n, rank r, round k``: the parts that are known."""
        parts = [
            f"{name} {value}"
            for name, value in (("node", self.node), ("rank", self.rank), ("round", self.round))
            if value not in (None, "")
        ]
        return ", ".join(parts)

    def describe(self) -> str:
        where = self.where()
        return f"{self.worker or '?'}: {self.error}" + (f" ({where})" if where else "")


def better_account(new: CountedFailure, stored: CountedFailure) -> bool:
    """Whether ``new`` should replace ``stored``, a report of the same incident (it stays one
    counted failure): a fatal error over any other, the worker's own error over a peer's."""
    return (new.fatal, new.own_error) > (stored.fatal, stored.own_error)


def count_once(failures: Iterable[CountedFailure]) -> tuple[CountedFailure, ...]:
    """``failures`` with every incident once (the first), in order."""
    seen: set[str] = set()
    counted = []
    for failure in failures:
        if failure.incident not in seen:
            seen.add(failure.incident)
            counted.append(failure)
    return tuple(counted)


# A round's failure reaches its agents together: the failing rank's with its own error, its
# peers' as a closed connection, often a moment sooner. A budget spent by a peer's account waits
# for the failing rank's own (it replaces the record: one incident) so that the job's result
# names the error itself: while any worker still runs (its agent may yet report; on a loaded
# node a torchrun agent can take seconds to see its worker's exit), up to this long; once every
# worker has ended nobody is left to report, and it fails with what it has.
OWN_ACCOUNT_WAIT_S = 15.0


@dataclass(frozen=True)
class FailureBudget:
    """The job's counted failures against its ``max_failures``; :meth:`spent` is its rule."""

    max_failures: int | None  # None: no budget (a torchrun job without a master)
    failures: tuple[CountedFailure, ...] = ()  # oldest first, each incident once

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", count_once(self.failures))

    @property
    def count(self) -> int:
        return len(self.failures)

    @property
    def last(self) -> CountedFailure | None:
        return self.failures[-1] if self.failures else None

    def with_failure(self, failure: CountedFailure) -> FailureBudget:
        return FailureBudget(self.max_failures, (*self.failures, failure))

    @property
    def exceeded(self) -> bool:
        """More than ``max_failures`` counted failures."""
        return self.max_failures is not None and self.count > self.max_failures

    def spent(self, waited_s: float = math.inf, workers_running: bool = True) -> str | None:
        """Why the job must fail now (None: it may go on): a fatal failure, or more than
        ``max_failures`` counted failures. The reason names the count and the failure.
        ``waited_s``: how long the count has been exceeded; a budget spent by a peer's account
        of the last failure waits for the failing rank's while ``workers_running`` (an agent
        may still report), up to :data:`OWN_ACCOUNT_WAIT_S`."""
        fatal = next((f for f in self.failures if f.fatal), None)
        if fatal is not None:
            return (
                f"{fatal.describe()}: an error no restart can fix, the job fails at its first "
                f"occurrence ({_failures(self.count)} counted)"
            )
        last = self.last
        if self.exceeded and last:
            if last.peers_error and workers_running and waited_s < OWN_ACCOUNT_WAIT_S:
                return None
            return (
                f"{_failures(self.count)} exceed --max-failures={self.max_failures}; "
                f"last: {last.describe()}"
            )
        return None


def _failures(count: int) -> str:
    return f"{count} worker failure{'' if count == 1 else 's'}"


# -- the edge: etcd ---------------------------------------------------------------------------
def record_failure(
    client: MultiEndpointEtcd3Client,
    run_prefix: str,
    failure: CountedFailure,
    count: bool = True,
) -> bool:
    """Count ``failure`` unless its incident is counted already (True: counted now). A report
    of a counted incident replaces the stored one when it is the better account of it
    (:func:`better_account`: the root cause), and the count stays. ``count=False``: only that
    replacement (a failure its agent judged free still gives the round's account its own
    error, when a peer's account of the round was counted)."""
    key = RunKeys(run_prefix).failure(failure.incident)
    tx = client.transactions
    stamped = failure if failure.t else _stamped(failure)
    for _ in range(3):  # another agent's report of the same incident may come in between
        if count:
            ok, _ = client.transaction(
                compare=[tx.version(key) == 0],
                success=[tx.put(key, stamped.to_json())],
                failure=[],
            )
            if ok:
                return True
        value, meta = client.get(key)
        if value is None:
            if count:
                continue
            return False
        if not better_account(stamped, CountedFailure.from_json(failure.incident, value)):
            return False
        ok, _ = client.transaction(
            compare=[tx.mod(key) == meta.mod_revision],
            success=[tx.put(key, stamped.to_json())],
            failure=[],
        )
        if ok:
            return False
    return False


def read_failures(client: MultiEndpointEtcd3Client, run_prefix: str) -> tuple[CountedFailure, ...]:
    """Every counted failure of the run, in the order they were counted."""
    root = RunKeys(run_prefix).failures
    entries = [
        (meta.create_revision, meta.key.decode()[len(root) :], value)
        for value, meta in client.get_prefix(root)
    ]
    return tuple(
        CountedFailure.from_json(incident, value) for _, incident, value in sorted(entries)
    )


def _stamped(failure: CountedFailure) -> CountedFailure:
    return CountedFailure(**{**asdict(failure), "t": time.time()})
