"""How much a simulated result depends on the sample: the same configuration over several seeds
(``simulate --seeds``), each seed its own sample of the trace. Pure: runs in, summaries out.

For each cluster size and job count, over the seeds: elastic's average JCT and mean pending time
as fractions of gang's (the goals' ratios), their mean, standard deviation, a 95 % confidence
interval of the mean (Student's t over the seeds, the samples being independent draws), the
range, and on how many seeds each goal holds. A JCT ratio is each seed's own (elastic / gang on
the same sample), so the spread is that of the comparison, not of the workload's size.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

JCT_GOAL = 0.6  # elastic / gang average JCT, at most
PENDING_GOAL = 0.2  # elastic / gang mean pending time, at most
# Two-sided 95 % quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond.
_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def parse_seeds(text: str) -> list[int]:
    """``"1-10"``, ``"1,2,5"`` or both mixed (``"1-3,7"``): the seeds, in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            low, high = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"expected seeds like 1-10 or 1,2,5, got {text!r}") from None
        if high < low:
            raise ValueError(f"a seed range runs upwards: {part!r}")
        seeds += [s for s in range(low, high + 1) if s not in seeds]
    if not seeds:
        raise ValueError(f"no seed in {text!r}")
    return seeds


def t95(samples: int) -> float:
    """The two-sided 95 % quantile of Student's t for the mean of ``samples`` values."""
    df = samples - 1
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def describe(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, standard deviation, 95 % confidence interval of the mean, range; one value has no
    spread (``None``)."""
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else None
    half = t95(n) * sd / math.sqrt(n) if sd is not None else None
    return {
        "n": n,
        "mean": round(mean, 4),
        "sd": None if sd is None else round(sd, 4),
        "ci95": None if half is None else [round(mean - half, 4), round(mean + half, 4)],
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def _ratio(run: Mapping[str, Any], metric: str) -> float | None:
    policies = run["policies"]
    if "gang" not in policies or "elastic" not in policies:
        return None
    gang = policies["gang"][metric]
    return policies["elastic"][metric] / gang if gang > 0 else None


def spread(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (gpus, jobs) over the runs' seeds, in the runs' order. A pending ratio
    is left out for a seed where gang has no queue (mean pending 0)."""
    groups: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["gpus"], run["jobs"]), []).append(run)
    out = []
    for (gpus, jobs), group in groups.items():
        summary: dict[str, Any] = {
            "gpus": gpus,
            "jobs": jobs,
            "jobs_per_gpu": group[0]["jobs_per_gpu"],
            "seeds": [run.get("seed") for run in group],
        }
        for metric, name, goal in (
            ("avg_jct_s", "jct_ratio", JCT_GOAL),
            ("mean_pending_s", "pending_ratio", PENDING_GOAL),
        ):
            ratios = [r for r in (_ratio(run, metric) for run in group) if r is not None]
            summary[name] = describe(ratios) if ratios else None
            summary[f"{name}_goal_met"] = sum(r <= goal for r in ratios)
        out.append(summary)
    return out


def mean_runs(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The runs of each (gpus, jobs) averaged over their seeds, metric by metric, as one run
    each (what the load figure draws)."""
    groups: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["gpus"], run["jobs"]), []).append(run)
    out = []
    for (gpus, jobs), group in groups.items():
        policies = {
            policy: {
                metric: statistics.fmean(run["policies"][policy][metric] for run in group)
                for metric in ("avg_jct_s", "mean_pending_s")
            }
            for policy in group[0]["policies"]
        }
        out.append({"gpus": gpus, "jobs": jobs, "policies": policies})
    return out
