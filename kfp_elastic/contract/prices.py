"""Prices per worker slot-hour and the two tiers they apply to (pure).

Worker indexes below ``min_workers`` are *guaranteed* (on-demand nodes), the others
*opportunistic* (spot nodes): ``master/pod_spec.py`` gives each its PriorityClass and
``master/cost.py`` folds what a job's slots cost at these prices. The job contract resolves them
(``KubernetesSettings.prices``) before any worker starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

GUARANTEED, OPPORTUNISTIC = "guaranteed", "opportunistic"
TIERS = (GUARANTEED, OPPORTUNISTIC)


@dataclass(frozen=True)
class Prices:
    """Prices per slot-hour (any currency); 0 on-demand: no cost shown."""

    on_demand: float = 0.0
    spot: float = 0.0

    @property
    def given(self) -> bool:
        return self.on_demand > 0

    def of(self, tier: str) -> float:
        """The price per slot-hour of ``tier``: guaranteed on on-demand nodes, opportunistic on
        spot nodes (on-demand ones when no spot price is given)."""
        if tier == GUARANTEED:
            return self.on_demand
        return self.spot or self.on_demand


NO_PRICES = Prices()


def price_from_env(env: Mapping[str, str], variable: str) -> float:
    """A price from ``env`` (empty: 0, not given); ``ValueError`` naming the variable."""
    text = env.get(variable, "").strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{variable}={text!r} (from the kfp-elastic-config ConfigMap or the environment) "
            "must be a price >= 0 per worker slot-hour"
        )
    return value
