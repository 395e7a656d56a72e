"""Shared pieces of ``benchmarks/elastic_runtime.py``: the workload's constants, the step
arithmetic and helpers that find an agent group's workers and read the runtime's log lines."""

from __future__ import annotations

import re
import statistics
from datetime import datetime
from pathlib import Path

from kfp_elastic.rendezvous.local_agents import AgentGroup

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "digits": "kfp_elastic.worker.examples.digits",
    "wide": "benchmarks.wide_digits",
    "1b": "benchmarks.billion_params",  # GPU only: 8.6 GB of state
}
TIMED = "benchmarks.timed_model_def"
BATCH = 32  # per worker
TRAIN_SAMPLES = 1437  # digits train split (80 % of 1,797)
SETUP_TIMEOUT_S = 300.0
HUGE = 10**9
AUTO = 0  # --snapshot-every auto (the runner's default)


def steps_per_epoch(world: int) -> int:
    return -(-TRAIN_SAMPLES // (world * BATCH))


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def worker_pids(group: AgentGroup) -> set[int]:
    """The processes below the group's agents (the workers), not the agents themselves."""
    pids: set[int] = set()
    for agent in group.agents:
        pids |= agent.tree_pids() - ({agent.pid} if agent.process else set())
    return pids


def agents_done(group: AgentGroup) -> bool:
    return all(not agent.alive() for agent in group.agents)


_WORKER_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] worker (\w+) (.*)$")


def worker_lines(text: str, needle: str) -> list[tuple[float, str]]:
    """(time.time(), message) of the runtime's log lines containing ``needle``."""
    found = []
    for line in text.splitlines():
        match = _WORKER_LINE.match(line)
        if match and needle in match.group(3):
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((stamp, match.group(3)))
    return found


def group_log(group: AgentGroup) -> str:
    return "\n".join(agent.log_text() for agent in group.agents)
