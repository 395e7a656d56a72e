"""How a worker ended, in its own words: ``{run}/ends/{worker}`` (``RunKeys.worker_end``).

The worker's loop (``worker/loop.py``: the runtime and the script API alike) writes it when it
knows: a SIGTERM it stopped on, or the job finished; from each node's local rank 0, as it ends. (An
error is not an end the runtime can tell: its agent may start it again; the agent records the errors
it counts, and whether it gave up, in ``errors/{worker}``, ``rendezvous/peer_failures.py``.) The
master reads it only for a worker whose pod (or process tree) is gone without a status to tell why:
one that ended while no master watched (``master.job.vanished_status``). No lease: it outlives the
worker.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import RunKeys

# The worker's logger: a user's script that configured no logging shows its lines
# (``worker/elastic.py``), as it shows the rest of the worker's.
log = logging.getLogger("kfp_elastic.worker")

#: ``WorkerEnd.end``: stopped on SIGTERM (the kubelet's notice of a preemption, eviction or
#: node shutdown), finished (exit 0), or stopped by its own agent because the run had no master
#: for ``orphan_timeout`` (``rendezvous/orphan.py``: written by the agent before the SIGTERM it
#: sends itself, and not replaced by the workers' ``sigterm`` that follows).
END_SIGTERM, END_COMPLETED, END_ORPHANED = "sigterm", "completed", "orphaned"
ENDS = (END_SIGTERM, END_COMPLETED, END_ORPHANED)


@dataclass(frozen=True)
class WorkerEnd:
    end: str  # one of ENDS
    t: float = 0.0  # the worker's unix time
    step: int = 0  # the last step it finished
    round: int = 0  # the rendezvous round it was in
    message: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> WorkerEnd | None:
        """None when ``text`` is not a record of a known ending (a newer writer's, or broken)."""
        try:
            data = json.loads(text)
            end = data["end"]
            if end not in ENDS:
                return None
            return cls(
                end,
                float(data.get("t", 0.0)),
                int(data.get("step", 0)),
                int(data.get("round", 0)),
                str(data.get("message", "")),
            )
        except (ValueError, TypeError, KeyError):
            return None


def record_end(
    client: MultiEndpointEtcd3Client, run_prefix: str, worker: str, end: WorkerEnd
) -> None:
    """Write ``end`` (never raises: the worker is ending, its own failure matters more). A
    ``sigterm`` does not replace an ``orphaned`` record: that SIGTERM is the orphan stop's."""
    try:
        if end.end == END_SIGTERM:
            before = read_end(client, run_prefix, worker)
            if before is not None and before.end == END_ORPHANED:
                return
        client.put(RunKeys(run_prefix).worker_end(worker), end.to_json())
        log.info("end recorded worker=%s end=%s step=%d", worker, end.end, end.step)
    except Exception as error:  # noqa: BLE001 - the pod status may still tell
        log.warning("end not recorded worker=%s end=%s error=%r", worker, end.end, error)


def read_end(client: MultiEndpointEtcd3Client, run_prefix: str, worker: str) -> WorkerEnd | None:
    value, _ = client.get(RunKeys(run_prefix).worker_end(worker))
    return WorkerEnd.from_json(value) if value is not None else None


def now_end(end: str, step: int, round_number: int, message: str = "") -> WorkerEnd:
    return WorkerEnd(end, time.time(), step, round_number, message[:1500])
