"""Real torchrun agents (gloo, one worker each) on the elastic-etcd backend.

Each test runs a tiny DDP job, disturbs it as a cluster would (SIGKILL of a whole node, a
hung node (SIGSTOP), SIGTERM as a preemption notice, a node joining) and checks the job trains
on and finishes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import (
    Agent,
    AgentGroup,
    first_step_with_world,
    new_run_id,
    read_events,
    tiny_ddp_args,
    wait_for_events,
)

BACKEND = "elastic-etcd"
STEP_TIME = 0.05
# Generous bounds: they only turn a hang into a failure, they do not measure speed.
FORM_TIMEOUT = 90
RECOVER_TIMEOUT = 60


def start_agents(
    group: AgentGroup,
    etcd,
    run_id: str,
    events: Path,
    count: int,
    nnodes: str,
    steps: int,
    agent_options: dict | None = None,
    **conf: object,
) -> list[Agent]:
    conf = {"last_call_timeout": 1, **conf}
    agents = []
    for index in range(count):
        agents.append(
            group.start(
                backend=BACKEND,
                endpoint=etcd.endpoint,
                run_id=run_id,
                nnodes=nnodes,
                script_args=tiny_ddp_args(
                    events, steps=steps, step_time=STEP_TIME, state_dir=events.parent
                ),
                rdzv_conf=conf,
                name=f"node{index}",
                **(agent_options or {}),
            )
        )
        time.sleep(0.3)  # registration order = node index, so node0 is rank 0
    return agents


def world_reached(group: AgentGroup, events: Path, world: int, after: float = 0.0):
    """The first step of a ``world``-process world; on a timeout the error says how far the job
    got (its worlds, whether it finished first) and ends with the agents' logs."""
    try:
        return wait_for_events(
            events,
            lambda ev: first_step_with_world(ev, world, after),
            FORM_TIMEOUT,
            what=f"a step of world {world}",
        )
    except TimeoutError as error:
        seen = read_events(events)
        worlds = sorted({e.get("world_size") for e in seen if e.get("event") == "step"} - {None})
        done = [e for e in seen if e.get("event") == "done"]
        raise TimeoutError(
            f"{error}; worlds trained: {worlds}; finished: {bool(done)}\n{group.logs()}"
        ) from error


def finished_ok(group: AgentGroup, agents: list[Agent], timeout: float = 120) -> None:
    codes = [agent.wait(timeout) for agent in agents]
    assert codes == [0] * len(agents), group.logs()


def stop_tree(agent: Agent) -> float:
    """SIGSTOP the agent and every process below it (a hung or cut-off host: sockets stay open,
    nothing answers, no lease refresh); returns time.time()."""
    stopped_at = time.time()
    for pid in [agent.pid, *agent.tree_pids()]:  # the agent first: it starts no new workers
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    return stopped_at


@pytest.mark.parametrize(
    ("victim", "how"),
    [(1, "sigkill"), (0, "sigkill"), (1, "hang")],
    ids=["non-first-node", "first-node", "hung-node"],
)
def test_a_lost_node_leaves_survivors_training(tmp_path: Path, etcd, victim: int, how: str) -> None:
    events = tmp_path / "events.jsonl"
    # A hung host closes no connection: only its lease running out (lease_ttl) tells the others.
    conf = {"lease_ttl": 3} if how == "hang" else {}
    with AgentGroup(tmp_path) as group:
        agents = start_agents(group, etcd, new_run_id(), events, 3, "2:3", steps=200, **conf)
        world_reached(group, events, 3)
        lost_at = agents[victim].sigkill_tree() if how == "sigkill" else stop_tree(agents[victim])
        step = wait_for_events(
            events,
            lambda ev: first_step_with_world(ev, 2, lost_at),
            RECOVER_TIMEOUT,
            what="a step of the 2-node world",
        )
        assert step["t"] > lost_at
        survivors = [a for i, a in enumerate(agents) if i != victim]
        if how == "hang":  # found by lease expiry, not by a probe connection ending
            logs = "".join(a.log_text() for a in survivors)
            assert "probe closed" not in logs and "probe refused" not in logs, group.logs()
        finished_ok(group, survivors)
    done = [e for e in read_events(events) if e["event"] == "done"]
    assert {e["world_size"] for e in done} == {2}
    restarted = [e for e in read_events(events) if e["event"] == "start" and e["t"] > lost_at]
    assert restarted and all(e["warm"] for e in restarted), "restarts are forked by the zygote"


def test_a_peer_loss_does_not_spend_a_restart(tmp_path: Path, etcd) -> None:
    # --max-restarts=0 (torchrun's default): a survivor that counted its worker's failure as
    # its own would give up. A long monitor interval makes the agent see the worker's failure
    # (gloo: peer reset) before it looks at num_nodes_waiting().
    events = tmp_path / "events.jsonl"
    with AgentGroup(tmp_path) as group:
        agents = start_agents(
            group,
            etcd,
            new_run_id(),
            events,
            3,
            "2:3",
            steps=150,
            agent_options={"max_restarts": 0, "monitor_interval": 2.0},
        )
        world_reached(group, events, 3)
        killed_at = agents[2].sigkill_tree()
        wait_for_events(
            events,
            lambda ev: first_step_with_world(ev, 2, killed_at),
            RECOVER_TIMEOUT,
            what="a step of the 2-node world",
        )
        finished_ok(group, agents[:2])
    # Which came first is a race: the worker's own crash (gloo: peer reset) seen by the agent's
    # monitor as a failure, or the monitor seeing the membership change and stopping the worker
    # (a restart that is no failure, even when the worker had just crashed). Whenever the
    # monitor saw a failure, its agent must have forgiven it (with grace 0 it gives up).
    for agent in agents[:2]:
        text = agent.log_text()
        failure_seen = re.search(r"failed \(exitcode: (?!-15\b)-?\d+\)", text)
        assert not failure_seen or "verdict=free" in text, group.logs()


def test_a_node_joining_grows_the_world(tmp_path: Path, etcd) -> None:
    events = tmp_path / "events.jsonl"
    run_id = new_run_id()
    with AgentGroup(tmp_path) as group:
        agents = start_agents(group, etcd, run_id, events, 3, "2:4", steps=120)
        world_reached(group, events, 3)
        joined_at = time.time()
        agents += start_agents(group, etcd, run_id, events, 1, "2:4", steps=120)
        wait_for_events(
            events,
            lambda ev: first_step_with_world(ev, 4, joined_at),
            RECOVER_TIMEOUT,
            what="a step of the 4-node world",
        )
        finished_ok(group, agents)
        # A replacement that arrives after the job succeeded ends cleanly: nothing to do.
        late = start_agents(group, etcd, run_id, events, 1, "2:4", steps=120)[0]
        assert late.wait(RECOVER_TIMEOUT) == 0, late.log_text()
        assert "completed before node" in late.log_text()
    # A new node's zygote is forked from its agent (torch already imported), not started cold.
    assert "forked from this agent" in agents[3].log_text(), agents[3].log_text()
    starts = [e for e in read_events(events) if e["event"] == "start" and e["t"] > joined_at]
    assert starts and all(e["warm"] for e in starts)


def test_sigterm_leaves_gracefully(tmp_path: Path, etcd) -> None:
    events = tmp_path / "events.jsonl"
    with AgentGroup(tmp_path) as group:
        # A long lease and no probe: only the graceful leave can make survivors re-form fast.
        agents = start_agents(
            group,
            etcd,
            new_run_id(),
            events,
            3,
            "2:3",
            steps=120,
            lease_ttl=600,
            peer_probe="false",
            warm_start="false",
        )
        world_reached(group, events, 3)
        terminated_at = agents[2].sigterm()
        agents[2].wait(60)
        wait_for_events(
            events,
            lambda ev: first_step_with_world(ev, 2, terminated_at),
            RECOVER_TIMEOUT,
            what="a step of the 2-node world after SIGTERM",
        )
        assert "leaving run" in agents[2].log_text()
        finished_ok(group, agents[:2])
    starts = [e for e in read_events(events) if e["event"] == "start"]
    assert starts and not any(e["warm"] for e in starts), "warm_start=false starts cold"
    assert "zygote" not in group.logs(tail=10_000)
