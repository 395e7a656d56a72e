"""``python -m benchmarks scheduling exp2 --quick`` end to end: serving beside training on the
test cluster (3 slots, serving 1 -> 2 -> 1 by the traffic's HPA stand-in, the elastic job in the
rest). The serving pods answer the traffic, the scale-up preempts training workers (no step lost),
the scale-down deletes the newest serving pods, and the result and its figure are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scheduling import exp2
from tests.helpers import REPO_ROOT


@pytest.mark.timeout(240)
def test_quick_serving_beside_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # the pods import benchmarks.*
    out = tmp_path / "exp2.json"
    assert exp2.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(result["goals"]) == {"utilization_outside_windows", "serving_room_wait"}
    assert {"all", "outside_windows", "inside_windows"} <= set(result["utilization"])

    up, down = result["scale_events"]
    assert (up["replicas_from"], up["replicas_to"], down["replicas_to"]) == (1, 2, 1)
    # both new serving pods got room (training workers preempted) and ran
    assert len(up["created"]) == 1 and len(up["room_s"]) == len(up["running_s"]) == 1
    assert up["victims"], "no training worker made room"
    causes = {lost["cause"] for lost in result["workers_lost"]}
    assert causes == {"preempted"}, result["workers_lost"]
    assert result["lost_steps"] == 0 and result["steps"] > 0
    # the scale-down removed the newest serving pod
    assert sorted(down["deleted"]) == sorted(up["created"])
    assert down["serving_settled_s"] is not None
    # the serving pods answered real requests; the slots were held by both owners
    assert result["traffic"]["answered"] > 0
    held = {
        column: max(row[i] for row in result["timeline"])
        for i, column in enumerate(result["timeline_columns"])
        if column != "t"
    }
    assert held == {"training": 2, "serving": 2}
    printed = capsys.readouterr().out
    assert "utilization_outside_windows" in printed and "serving_room_wait" in printed
