"""The etcd key schema of one run. Every key of a run lives under ``{key_prefix}/{run_id}/``.

| key                                   | value                         | bound to lease |
|---------------------------------------|-------------------------------|----------------|
| ``{run}/rdzv/run``                    | JSON ``{"lease": id}``        | run lease      |
| ``{run}/rdzv/nodes/{node_id}``        | JSON node record              | node's lease   |
| ``{run}/rdzv/round``                  | JSON round record             | run lease      |
| ``{run}/rdzv/closed``                 | JSON ``{"by": node_id}``      | run lease      |
| ``{run}/rdzv/leader``                 | JSON leader record            | leader's lease |
| ``{run}/rdzv/rank0``                  | JSON MASTER_ADDR/PORT of a round | run lease   |
| ``{run}/store/{round}/{key}``         | bytes given by torch          | run lease      |
| ``{run}/errors/{worker}``             | JSON last counted worker error | none          |

The run lease is created by the leader of the first round and, once it exists, kept alive by
every live node; once the last node has left it expires after ``close_timeout`` and takes every
key of the run with it. Values we write are JSON, never pickle. ``errors/{worker}`` (written by
an agent whose workers failed, ``peer_failures.py``; ``{worker}`` is the master's worker name)
is not bound to a lease: the master reads it after the agent is gone.
Issue-3 parts (master, shards, events) add their own sub-prefixes next to ``rdzv/`` and ``store/``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunKeys:
    run_prefix: str  # e.g. "/kfp-elastic/job-1"

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

    def worker_error(self, worker: str) -> str:
        return f"{self.run_prefix}/errors/{worker}"


def prefix_range_end(prefix: str) -> str:
    """The exclusive end of etcd's range for ``prefix`` (last byte + 1)."""
    data = bytearray(prefix.encode())
    data[-1] += 1
    return data.decode()
