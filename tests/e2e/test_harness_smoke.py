"""Smoke test of the harness: two c10d agents run examples/tiny_ddp.py to the end."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import AgentGroup, free_port, read_events, tiny_ddp_args

STEPS = 5


@pytest.mark.timeout(120)
def test_two_c10d_agents_finish_tiny_ddp(tmp_path: Path) -> None:
    events_path = tmp_path / "events.jsonl"
    endpoint = f"127.0.0.1:{free_port()}"
    common = {
        "backend": "c10d",
        "endpoint": endpoint,
        "run_id": "smoke",
        "nnodes": "2",
        "max_restarts": 0,
        "disable_shared_store": True,
        "script_args": tiny_ddp_args(events_path, steps=STEPS, step_time=0.0, state_dir=tmp_path),
    }
    with AgentGroup(tmp_path / "logs") as group:
        group.start(name="host", rdzv_conf={"is_host": 1}, **common)
        group.start(name="client", rdzv_conf={"is_host": 0}, **common)
        try:
            codes = group.wait_all(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agents did not finish in 90 s\n{group.logs()}")
        assert codes == [0, 0], group.logs()

    events = read_events(events_path)
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1], events
    assert all(e["step"] == STEPS for e in done)
    assert {e["world_size"] for e in events} == {2}
    assert max(e["step"] for e in events if e["event"] == "step") == STEPS
    assert (tmp_path / "smoke.step").read_text() == str(STEPS)
