"""The kill and join scenarios of ``benchmarks/rendezvous_recovery.py``: torchrun agents on
local processes lose a node (SIGKILL of its process tree) or gain one; seconds until the first
training step of the new world."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.rendezvous_recovery_common import (
    Backend,
    Run,
    first_after,
    log_times,
    plugin_log_times,
)
from kfp_elastic.rendezvous.local_agents import (
    AGENT,
    TORCHRUN,
    AgentGroup,
    first_step_with_world,
    new_run_id,
    read_events,
    tiny_ddp_args,
    wait_for_events,
)

SETUP_TIMEOUT_S = 120.0  # to reach the starting world before the measured event
SETTLE_S = 1.0  # train this long in the starting world before the event


def run_agents_scenario(
    backend: Backend, scenario: str, args: argparse.Namespace, work_dir: Path
) -> Run:
    run_id = new_run_id(f"{scenario}-{backend.spec.name}")
    run = Run(scenario=scenario, run_id=run_id)
    run_dir = work_dir / run_id
    events = run_dir / "events.jsonl"
    endpoint = backend.endpoint()
    group = AgentGroup(run_dir / "logs")
    ours = backend.spec.name == "elastic-etcd" and args.elastic_launcher == "agent"
    launcher = AGENT if ours else TORCHRUN

    def start(index: int) -> Any:
        return group.start(
            name=f"node{index}",
            backend=backend.spec.name,
            endpoint=endpoint,
            run_id=run_id,
            nnodes="2:3",
            max_restarts=10,
            monitor_interval=0.2,
            rdzv_conf=backend.agent_conf(index, args.last_call_timeout),
            disable_shared_store=backend.spec.disable_shared_store,
            launcher=launcher,
            env={"LOGLEVEL": "INFO"},  # torchrun's rendezvous/restart lines, for the logs
            script_args=tiny_ddp_args(events, step_time=args.step_time, state_dir=run_dir),
        )

    with group:
        try:
            first_world = 3 if scenario == "kill" else 2
            target_world = 5 - first_world
            for index in range(first_world):
                start(index)
            wait_for_events(
                events,
                lambda evs: first_step_with_world(evs, first_world),
                SETUP_TIMEOUT_S,
                what=f"a step of the {first_world}-node world",
            )
            time.sleep(SETTLE_S)
            if scenario == "kill":
                victim = group.agents[2]  # never node0: the c10d store host
                pids = victim.tree_pids()
                ranks = [e for e in read_events(events) if e["pid"] in pids]
                run.victim_group_rank = ranks[-1]["group_rank"] if ranks else None
                event_t = victim.sigkill_tree()
            else:
                event_t = start(2).started_at or time.time()
            try:
                step = wait_for_events(
                    events,
                    lambda evs: first_step_with_world(evs, target_world, after_t=event_t),
                    args.cap,
                    what=f"a step of the {target_world}-node world",
                )
                run.recovered = True
                run.seconds = round(step["t"] - event_t, 3)
            except TimeoutError as error:
                run.error = str(error)
            run.event_t = event_t
            year = time.localtime(event_t).tm_year
            logs = "\n".join(a.log_text() for a in group.agents if a.alive())
            run.worker_failed_s = first_after(log_times(logs, "failed (exitcode", year), event_t)
            run.rendezvous_done_s = first_after(
                log_times(logs, "Rendezvous complete", year), event_t
            )
            if scenario == "join":
                run.registered_s = first_after(
                    plugin_log_times(group.agents[2].log_text(), "registered node="), event_t
                )
            after = [e for e in read_events(events) if e["t"] > event_t]
            starts = [e["t"] for e in after if e["event"] == "start"]
            run.worker_start_s = round(min(starts) - event_t, 3) if starts else None
            run.restart_counts = sorted(
                {
                    e["restart_count"]
                    for e in after
                    if e["event"] == "step" and e["world_size"] == target_world
                }
            )
        except Exception as error:  # noqa: BLE001 - one failed run must not end the benchmark
            run.error = f"{type(error).__name__}: {error}"
        if not run.recovered:
            run.logs = group.logs(tail=15)
    return run
