"""A job whose committed losses are not finite never ends as succeeded."""

from __future__ import annotations

from kfp_elastic.master.job import non_finite_loss
from kfp_elastic.worker.progress import Committed


def test_a_finite_or_absent_loss_curve_can_succeed() -> None:
    assert non_finite_loss(None) is None
    assert non_finite_loss(Committed(10, 1, 0, complete=True)) is None
    assert non_finite_loss(Committed(10, 1, 0, complete=True, losses=(0.5, 0.4))) is None


def test_a_nan_or_inf_loss_names_its_step() -> None:
    committed = Committed(10, 1, 0, complete=True, losses=(0.5, float("nan"), 0.4))
    assert non_finite_loss(committed) == "training loss is not finite (nan) at step 9"
    assert "(inf) at step 10" in str(non_finite_loss(Committed(10, 1, 0, losses=(float("inf"),))))
