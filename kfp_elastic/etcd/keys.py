"""The one etcd key schema: every key the project writes, built here and nowhere else.

Every key of a run lives under ``{run}`` = ``{key_prefix}/{run_id}`` (:func:`run_prefix_of`);
values we write are JSON, never pickle. Each concept has a sub-prefix of its own (a test checks
that no two share one), so ``etcdctl get --prefix {run}/<part>/`` shows exactly one part.

| key: {run}/...                 | value (JSON unless noted)                      | lease    |
|--------------------------------|------------------------------------------------|----------|
| *rendezvous/*                  |                                                |          |
| rdzv/run                       | ``{"lease": id}``                              | run      |
| rdzv/nodes/{node_id}           | ``{"waiting", "after_round", "addr", ...}``    | node's   |
| rdzv/round                     | ``{"round", "participants", "run_lease", "t",  | run      |
|                                | "history"}``: t = formed at (leader's time)    |          |
| rdzv/closed                    | ``{"by": node_id, "outcome": CLOSED_*}``       | run      |
| rdzv/leader                    | ``{"node", "lease", "probe"}``                 | leader's |
| rdzv/rank0                     | ``{"round", "node", "addr", "port"}``          | run      |
| store/{N}/{key}                | raw bytes from torch (round N's store)         | run      |
| *rendezvous/peer_failures.py*  |                                                |          |
| errors/{worker}                | ``{"error", "verdict", ...}``: last counted    | -        |
|                                | worker error of an agent (≤ 1.5 KB of text)    |          |
| *contract/failure_budget.py*   |                                                |          |
| failures/{incident}            | ``CountedFailure``: one failure counted        | -        |
|                                | against ``max_failures`` (agents and master)   |          |
| *contract/worker_end.py*      |                                                |          |
| ends/{worker}                  | ``{"end", "t", "step", "round", "message"}``:  | -        |
|                                | how a worker ended, in its own words           |          |
| *master/state.py*              |                                                |          |
| master/leader                  | ``{"id", "host", "pid", "since"}``             | master's |
| master/spec                    | the job spec of the latest start               | -        |
| master/status                  | ``{"state", "message", "t"}``                  | -        |
| master/workers/{name}          | ``{"index", "attempt", "ended", ...}``         | -        |
| master/observed                | ``{"round_revision", "commit_revision", ...}`` | -        |
| master/ladder                  | ``{"level", "last_move_at", ...}`` (a ladder)  | -        |
| master/event_seq               | last event sequence number (text)              | -        |
| *master/timeline.py*           |                                                |          |
| events/{seq:010d}              | ``{"t", "kind", ...}``: one typed event        | -        |
| *worker/progress.py*           |                                                |          |
| progress/committed             | ``Committed``: step, epoch, position, at,      | -        |
|                                | round, recent (the last 64 commits), ...       |          |
| progress/base_world_size       | world size the batch policy scales from        | -        |
| shards/manifest                | ``{"shards": [[id, start, end]...], ...}``     | -        |
| shards/epoch/{e}/todo/{shard}  | ``{}``                                         | -        |
| shards/epoch/{e}/doing/{shard} | ``{"consumed": n}``                            | -        |
| shards/epoch/{e}/done/{shard}  | ``{}``                                         | -        |

Written by the module in *italics*. Lease: ``run`` = the run lease; ``node's``,
``leader's``, ``master's`` = that process's own lease; ``-`` = none.

``master/leader`` is also the master's liveness record: the agents of a job a master started
read it (``rendezvous/orphan.py``) and stop their workers once it has been absent for the job's
``orphan_timeout_s``.

The run lease (TTL ``close_timeout``) is created by the leader of the first round and kept alive
by every live node; once the last node has left it expires and takes the rendezvous keys and
the store with it. Master, timeline, progress and shard keys have no lease: they outlive every
process, so a new master or a KFP retry continues the run; the pipeline's exit handler
(``stop_workers``: ``components.common.forget_run``) deletes the whole ``{run}/`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The shard queues' states, in the order a shard moves through them.
QUEUE_STATES = ("todo", "doing", "done")
#: Digits of an event's sequence number in its key (keys sort in sequence order).
EVENT_SEQ_DIGITS = 10
#: ``rdzv/closed``'s ``outcome``: the closing agent's workers all succeeded (the job is done:
#: a node arriving later exits 0), its agent gave up (``close_on_failure``), or it is not known
#: (torch's ``set_closed()``).
CLOSED_SUCCEEDED, CLOSED_FAILED, CLOSED_UNKNOWN = "succeeded", "failed", "closed"


def run_prefix_of(key_prefix: str, run_id: str) -> str:
    """``{key_prefix}/{run_id}``: the root of every key of one run."""
    return f"{key_prefix.rstrip('/')}/{run_id}"


def prefix_range_end(prefix: str) -> str:
    """The exclusive end of etcd's range for ``prefix`` (last byte + 1)."""
    data = bytearray(prefix.encode())
    data[-1] += 1
    return data.decode()


@dataclass(frozen=True)
class MasterKeys:
    """``{run}/master/``: the master's leadership and job state."""

    run_prefix: str

    @property
    def root(self) -> str:
        return f"{self.run_prefix}/master/"

    @property
    def leader(self) -> str:
        return f"{self.root}leader"

    @property
    def spec(self) -> str:
        return f"{self.root}spec"

    @property
    def status(self) -> str:
        return f"{self.root}status"

    @property
    def workers(self) -> str:
        return f"{self.root}workers/"

    def worker(self, name: str) -> str:
        return f"{self.workers}{name}"

    @property
    def observed(self) -> str:
        return f"{self.root}observed"

    @property
    def ladder(self) -> str:
        """The job's place on the least-attained-service ladder (``master/ladder.py``)."""
        return f"{self.root}ladder"

    @property
    def event_seq(self) -> str:
        return f"{self.root}event_seq"


@dataclass(frozen=True)
class TimelineKeys:
    """``{run}/events/``: the typed event timeline, one key per event."""

    run_prefix: str

    @property
    def root(self) -> str:
        return f"{self.run_prefix}/events/"

    def event(self, seq: int) -> str:
        return f"{self.root}{seq:0{EVENT_SEQ_DIGITS}d}"

    def seq_of(self, key: str | bytes) -> int:
        """The sequence number an event key carries."""
        text = key.decode() if isinstance(key, bytes) else key
        return int(text.rsplit("/", 1)[1])


@dataclass(frozen=True)
class ProgressKeys:
    """``{run}/progress/`` (the committed position) and ``{run}/shards/`` (manifest, queues)."""

    run_prefix: str

    @property
    def root(self) -> str:
        return f"{self.run_prefix}/progress/"

    @property
    def committed(self) -> str:
        return f"{self.root}committed"

    @property
    def base_world_size(self) -> str:
        return f"{self.root}base_world_size"

    @property
    def shards(self) -> str:
        return f"{self.run_prefix}/shards/"

    @property
    def manifest(self) -> str:
        return f"{self.shards}manifest"

    def epoch(self, epoch: int) -> str:
        return f"{self.shards}epoch/{epoch}/"

    def queue(self, epoch: int, state: str, shard_id: int | None = None) -> str:
        if state not in QUEUE_STATES:
            raise ValueError(f"queue state must be one of {QUEUE_STATES}, got {state!r}")
        base = f"{self.epoch(epoch)}{state}/"
        return base if shard_id is None else f"{base}{shard_id}"


@dataclass(frozen=True)
class RunKeys:
    """Every key of one run: the rendezvous keys directly, the other parts as attributes."""

    run_prefix: str  # e.g. "/kfp-elastic/job-1" (see run_prefix_of())

    # -- rendezvous ---------------------------------------------------------------------------
    @property
    def rdzv(self) -> str:
        return f"{self.run_prefix}/rdzv/"

    @property
    def run(self) -> str:
        return f"{self.rdzv}run"

    @property
    def nodes(self) -> str:
        return f"{self.rdzv}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def round(self) -> str:
        return f"{self.rdzv}round"

    @property
    def closed(self) -> str:
        return f"{self.rdzv}closed"

    @property
    def leader(self) -> str:
        return f"{self.rdzv}leader"

    @property
    def rank0(self) -> str:
        # Sorts after ``nodes/`` like ``round``: a narrowed cache watches both with one range,
        # so a round written with its rank 0's address reaches a waiter in one watch response.
        return f"{self.rdzv}rank0"

    @property
    def store_root(self) -> str:
        return f"{self.run_prefix}/store/"

    def store(self, round_number: int) -> str:
        return f"{self.store_root}{round_number}/"

    @property
    def errors(self) -> str:
        # Not bound to a lease: the master reads an agent's error after the agent is gone.
        return f"{self.run_prefix}/errors/"

    def worker_error(self, worker: str) -> str:
        """``{worker}`` is the master's worker name (``KFP_ELASTIC_WORKER_NAME``)."""
        return f"{self.errors}{worker}"

    @property
    def failures(self) -> str:
        # Not bound to a lease: the job's one failure budget outlives every agent and master.
        return f"{self.run_prefix}/failures/"

    def failure(self, incident: str) -> str:
        """One counted failure (``failure_budget``: one key per incident, created once)."""
        return f"{self.failures}{incident}"

    @property
    def ends(self) -> str:
        # Not bound to a lease: a master that was away reads it after the worker is gone.
        return f"{self.run_prefix}/ends/"

    def worker_end(self, worker: str) -> str:
        """How worker ``{worker}`` (the master's name for it) ended, in its own words."""
        return f"{self.ends}{worker}"

    # -- the other parts ----------------------------------------------------------------------
    @property
    def master(self) -> MasterKeys:
        return MasterKeys(self.run_prefix)

    @property
    def timeline(self) -> TimelineKeys:
        return TimelineKeys(self.run_prefix)

    @property
    def progress(self) -> ProgressKeys:
        return ProgressKeys(self.run_prefix)
