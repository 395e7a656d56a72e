"""Local demo: an elastic DDP job survives a node loss and grows back, no cluster needed.

    kfp-elastic demo [--steps 600] [--workdir DIR]

Starts an embedded etcd, three ``torchrun --rdzv-backend=elastic-etcd --nnodes=2:3`` agents of
``examples/tiny_ddp.py``, SIGKILLs the whole process tree of one node mid-run, starts a new node,
and prints the world size as it goes 3 → 2 → 3 until the job finishes. Everything it started is
stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.testing.nodes import (
    AgentGroup,
    first_step_with_world,
    new_run_id,
    read_events,
    tiny_ddp_args,
    wait_for_events,
)

PHASE_TIMEOUT_S = 120


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def latest_step(events_path: Path) -> tuple[int, int]:
    steps = [e for e in read_events(events_path) if e.get("event") == "step"]
    if not steps:
        return 0, 0
    last = max(steps, key=lambda e: e["t"])
    return last["step"], last["world_size"]


def progress_line(events_path: Path) -> str:
    step, world = latest_step(events_path)
    return f"training with world size {world} at step {step}"


def wait_world(events_path: Path, world: int, after: float, what: str) -> float:
    step = wait_for_events(
        events_path, lambda ev: first_step_with_world(ev, world, after), PHASE_TIMEOUT_S, what=what
    )
    return step["t"]


def run(steps: int, workdir: Path) -> int:
    events = workdir / "events.jsonl"
    run_id = new_run_id("demo")
    say(f"workdir {workdir} (agent logs, events.jsonl)")
    with EmbeddedEtcd() as etcd, AgentGroup(workdir) as group:
        say(f"embedded etcd at {etcd.endpoint}")

        def start_node(name: str) -> None:
            group.start(
                backend="elastic-etcd",
                endpoint=etcd.endpoint,
                run_id=run_id,
                nnodes="2:3",
                name=name,
                rdzv_conf={"last_call_timeout": 1},
                script_args=tiny_ddp_args(events, steps=steps, step_time=0.05, state_dir=workdir),
            )

        for index in range(3):
            start_node(f"node{index}")
        say(f"started 3 torchrun agents, run id {run_id}, --nnodes=2:3")
        wait_world(events, 3, 0.0, "the 3-node world")
        time.sleep(3)
        say(progress_line(events))

        killed_at = group.agents[1].sigkill_tree()
        say("SIGKILLed node1's whole process tree (a preempted node)")
        recovered = wait_world(events, 2, killed_at, "the 2-node world")
        say(f"survivors train with world size 2, {recovered - killed_at:.1f}s after the kill")
        time.sleep(3)
        say(progress_line(events))

        joined_at = time.time()
        start_node("node3")
        say("started node3 (a replacement node)")
        grown = wait_world(events, 3, joined_at, "the grown 3-node world")
        say(f"world size back to 3, {grown - joined_at:.1f}s after node3 started")

        survivors = [a for a in group.agents if a.name != "node1"]
        deadline = time.monotonic() + PHASE_TIMEOUT_S + steps * 0.1
        while any(a.alive() for a in survivors) and time.monotonic() < deadline:
            time.sleep(2)
            say(progress_line(events))
        codes = [a.returncode for a in survivors]
        if codes != [0] * len(survivors):
            say(f"agents ended with codes {codes}; logs:\n{group.logs()}")
            return 1
    worlds = []
    for event in sorted(read_events(events), key=lambda e: e["t"]):
        if event.get("event") == "step" and (not worlds or worlds[-1] != event["world_size"]):
            worlds.append(event["world_size"])
    say(f"job finished {steps} steps; world sizes over time: {' → '.join(map(str, worlds))}")
    say("everything started by the demo has been stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kfp-elastic demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="total training steps")
    parser.add_argument("--workdir", type=Path, help="logs and events (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kfp-elastic demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args.steps, workdir)
    except KeyboardInterrupt:
        say("interrupted; stopped everything")
        return 130


if __name__ == "__main__":
    sys.exit(main())
