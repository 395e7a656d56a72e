"""A small given workload instead of a trace sample: experiment 1's jobs, simulated and compared
with what the test cluster measured.

:func:`read_measured` reads an experiment-1 result (the JSON the run on the test cluster writes):

- ``slots``: the cluster's worker slots; ``job_type``, ``global_batch``, ``steps``: every job
  trains ``steps`` optimizer steps of ``global_batch`` samples, each lasting
  ``throughput.step_seconds(job_type, world, global_batch)`` (the paced model definition,
  ``benchmarks/timed_model_def.py``, sleeps that long); ``job_type`` null: linear scaling from
  ``solo_s`` (seconds a job runs alone at its size), for a reference run of another system;
- ``max_workers`` (per job, or ``workers``/``max_workers`` at the top; the slots a job asks
  for) and ``min_workers`` (per job or per policy; gang: ``max_workers``, elastic: 1 unless
  given);
- ``measured_costs``, per policy (``measured_costs.<policy>``, as experiment 1 writes them) or
  one set for both: ``pod_start_s`` (a worker bound while its job does not train → its first
  step), ``join_s`` (a worker bound while its job trains → the first step of the bigger world;
  the pod start where none was measured: nothing joins under gang), ``shrink_s`` (a training
  worker lost → the first step of the smaller world; 0 where none was measured: nothing shrinks
  in experiment 1), optionally ``join_pause_s`` (the part of ``join_s`` the running world stands
  still), ``submit_to_first_bind_s`` (by job: the master's start; the job reaches the cluster
  that much after its submission; where it is missing, the first ``bound_s`` of the job's
  ``pods`` minus its ``submit_s``) and ``step_s`` ({world: s}) or ``step_s_by_world``
  ({policy: {job: {world: s}}}) for the check of the curve; each a number, a list of
  measurements or measurements by job (the median is used);
- ``policies.<gang|elastic>``: ``makespan_s``, ``utilization`` and ``jobs[i]`` with
  ``submit_s``, ``first_step_s``, ``end_s``, ``pending_s``, ``jct_s`` (seconds since the
  experiment's start).

:func:`simulate_measured` runs each measured policy over the same jobs (each policy with its own
measured submit times) on the simulator, gang *without* an admission queue: on the test cluster
a gang job's master asks for all its workers at once, those that fit bind and wait (the
rendezvous waits for MIN = MAX), as ``kfp_elastic.master.scaling.decide`` and the scheduler's
``plan`` do in the simulator. :func:`compare` puts the simulated makespan and each job's JCT
beside the measured ones: relative error, PASS within :data:`TOLERANCE`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.scheduling import throughput
from benchmarks.scheduling.occupancy import Sample
from benchmarks.scheduling.simulator import Costs, Result, Simulation
from benchmarks.scheduling.trace import Job

TOLERANCE = 0.10  # relative error of a simulated time against the measured one


@dataclass(frozen=True)
class MeasuredJob:
    name: str
    submit_s: float
    max_workers: int
    min_workers: int
    first_step_s: float | None
    jct_s: float | None
    master_start_s: float = 0.0  # submission -> its first worker pod bound (the master starts)


@dataclass(frozen=True)
class Measured:
    """One experiment-1 result, as the simulator needs it."""

    slots: int
    job_type: str | None
    global_batch: float | None
    steps: int | None
    solo_s: float | None
    costs: Mapping[str, Costs]  # per policy
    step_s: Mapping[int, float]  # measured seconds per step by world size (median over jobs)
    jobs: Mapping[str, Sequence[MeasuredJob]]  # policy -> its jobs
    makespan_s: Mapping[str, float | None]
    utilization: Mapping[str, float | None]
    source: str


def _number(value: Any, what: str) -> float:
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{what}: an empty list of measurements")
        value = statistics.median(float(v) for v in value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number of seconds, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{what}: expected >= 0, got {number}")
    return number


def _optional(data: Mapping[str, Any], key: str) -> float | None:
    return None if data.get(key) is None else _number(data[key], key)


def read_measured(path: Path) -> Measured:
    """An experiment-1 result file (see the module's docstring); a clear error for what is
    missing."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"workload {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"workload {path}: not JSON ({error})") from None
    return measured_from(data, str(path))


def measured_from(data: Mapping[str, Any], source: str = "<dict>") -> Measured:
    """:func:`read_measured` on parsed JSON."""

    def need(mapping: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in mapping or mapping[key] is None:
            raise ValueError(f"workload {source}: {where} has no {key!r}")
        return mapping[key]

    slots = int(need(data, "slots", "the result"))
    job_type = data.get("job_type")
    if job_type is not None and job_type not in throughput.JOB_TYPES:
        raise ValueError(
            f"workload {source}: unknown job_type {job_type!r}; "
            f"known: {', '.join(throughput.JOB_TYPES)} or null (linear, with solo_s)"
        )
    global_batch = _optional(data, "global_batch")
    steps = None if data.get("steps") is None else int(data["steps"])
    solo_s = _optional(data, "solo_s")
    if job_type is not None and (global_batch is None or not steps):
        raise ValueError(f"workload {source}: a job_type needs global_batch and steps")
    if job_type is None and solo_s is None:
        raise ValueError(f"workload {source}: without a job_type, give solo_s")
    raw = need(data, "measured_costs", "the result")
    policies = need(data, "policies", "the result")
    if not policies:
        raise ValueError(f"workload {source}: no policies")
    costs = {policy: _costs(raw, policy, source) for policy in policies}
    step_s = _step_times(raw)
    jobs, makespan, utilization = {}, {}, {}
    for policy, measured in policies.items():
        cost = raw.get(policy) if isinstance(raw.get(policy), dict) else raw
        master = cost.get("submit_to_first_bind_s") or {}
        rows = need(measured, "jobs", f"policies.{policy}")
        listed = []
        for i, row in enumerate(rows):
            where = f"policies.{policy}.jobs[{i}]"
            max_workers = int(
                row.get("max_workers") or data.get("workers") or need(data, "max_workers", where)
            )
            default_min = max_workers if policy == "gang" else 1
            min_workers = int(row.get("min_workers") or measured.get("min_workers") or default_min)
            if not 1 <= min_workers <= max_workers <= slots:
                raise ValueError(
                    f"workload {source}: {where}: need 1 <= min_workers ({min_workers}) <= "
                    f"max_workers ({max_workers}) <= slots ({slots})"
                )
            listed.append(
                MeasuredJob(
                    str(row.get("name") or f"job-{i + 1}"),
                    _number(need(row, "submit_s", where), f"{where}.submit_s"),
                    max_workers,
                    min_workers,
                    _optional(row, "first_step_s"),
                    _optional(row, "jct_s"),
                    _master_start(master, row, i, where),
                )
            )
        jobs[policy] = listed
        makespan[policy] = _optional(measured, "makespan_s")
        utilization[policy] = measured.get("utilization")
    return Measured(
        slots,
        job_type,
        global_batch,
        steps,
        solo_s,
        costs,
        step_s,
        jobs,
        makespan,
        utilization,
        source,
    )


def _master_start(master: dict[str, Any], row: dict[str, Any], i: int, where: str) -> float:
    """The job's submission -> first worker pod bound: ``submit_to_first_bind_s`` by job, else
    from the job's own pods (``pods.<name>.bound_s``, as experiment 1 records them), else 0."""
    name = str(row.get("name") or f"job-{i + 1}")
    if name in master:
        return _number(master[name], where)
    bound = [
        pod["bound_s"]
        for pod in (row.get("pods") or {}).values()
        if isinstance(pod, dict) and isinstance(pod.get("bound_s"), (int, float))
    ]
    if bound and isinstance(row.get("submit_s"), (int, float)):
        return max(0.0, min(bound) - float(row["submit_s"]))
    return 0.0


def _seconds(value: Any, what: str) -> float:
    """A cost: a number, a list of measurements or measurements by job (their median)."""
    if isinstance(value, dict):
        value = list(value.values())
    return _number(value, what)


def _costs(raw: Mapping[str, Any], policy: str, source: str) -> Costs:
    """A policy's costs: ``measured_costs.<policy>`` where the file measures them per policy
    (experiment 1 does), else ``measured_costs`` itself. A cost the run did not measure
    because nothing paid it there (a shrink in experiment 1; a join under gang) is 0; the pod
    start must be given."""
    cost = raw.get(policy) if isinstance(raw.get(policy), dict) else raw
    where = f"measured_costs{'.' + policy if cost is not raw else ''}"
    if cost.get("pod_start_s") in (None, {}, []):
        raise ValueError(f"workload {source}: {where} has no 'pod_start_s'")
    start = _seconds(cost["pod_start_s"], f"{where}.pod_start_s")
    join = cost.get("join_s")
    if join is None and cost is raw:
        raise ValueError(f"workload {source}: {where} has no 'join_s'")
    join_s = start if join is None else _seconds(join, f"{where}.join_s")
    pause = min(_seconds(cost.get("join_pause_s") or 0.0, f"{where}.join_pause_s"), join_s)
    return Costs(
        join_s=join_s,
        shrink_s=_seconds(cost.get("shrink_s") or 0.0, f"{where}.shrink_s"),
        start_s=start,
        join_pause_s=pause,
    )


def _step_times(raw: Mapping[str, Any]) -> dict[int, float]:
    """Measured seconds per step by world size: ``step_s`` ({world: s}) or experiment 1's
    ``step_s_by_world`` ({policy: {job: {world: s}}}), the median over jobs and policies."""
    found: dict[int, list[float]] = {}
    for world, value in (raw.get("step_s") or {}).items():
        found.setdefault(int(world), []).append(_number(value, f"step_s[{world}]"))
    for jobs in (raw.get("step_s_by_world") or {}).values():
        for by_world in jobs.values():
            for world, value in by_world.items():
                found.setdefault(int(world), []).append(_number(value, f"step_s[{world}]"))
    return {world: statistics.median(values) for world, values in sorted(found.items())}


PACES = ("curve", "measured")


def pace_factor(measured: Measured) -> float:
    """How much slower the real run trained than the curve it was paced by: the median over
    the gang jobs (which train at their full size from the first step to the end, alone) of
    ``(submit_s + jct_s - first_step_s) / steps`` over the curve's step at that size. Every
    pause of the real runtime (snapshots, epoch ends, commits, a loaded machine) is in it; 1.0
    where nothing measured it."""
    if measured.job_type is None or not measured.steps:
        return 1.0
    ratios = []
    for job in measured.jobs.get("gang", ()):
        if job.first_step_s is None or job.jct_s is None:
            continue
        trained = job.submit_s + job.jct_s - job.first_step_s  # first step -> end
        if trained <= 0:
            continue
        curve = throughput.step_seconds(
            measured.job_type,
            job.max_workers,
            measured.global_batch,  # type: ignore[arg-type]
        )
        ratios.append(trained / measured.steps / curve)
    return statistics.median(ratios) if ratios else 1.0


def solo_seconds(measured: Measured, gpus: int, pace: str = "curve") -> float:
    """How long one job runs alone at ``gpus`` workers, training only (no start cost): the
    curve's step time × steps, times :func:`pace_factor` with ``pace="measured"``."""
    if measured.job_type is None:
        return measured.solo_s  # type: ignore[return-value]
    step = throughput.step_seconds(measured.job_type, gpus, measured.global_batch)  # type: ignore[arg-type]
    factor = pace_factor(measured) if pace == "measured" else 1.0
    return measured.steps * step * factor  # type: ignore[operator]


def step_check(measured: Measured) -> dict[str, dict[str, float | None]]:
    """Seconds per step by world size: the curve the simulator uses against the measured solo
    step times (empty without a job type)."""
    if measured.job_type is None:
        return {}
    return {
        str(world): {
            "curve": round(
                throughput.step_seconds(measured.job_type, world, measured.global_batch),
                4,  # type: ignore[arg-type]
            ),
            "measured": measured.step_s.get(world),
        }
        for world in range(1, max(j.max_workers for js in measured.jobs.values() for j in js) + 1)
    }


def jobs_of(measured: Measured, policy: str, pace: str = "curve") -> list[Job]:
    """The simulator's jobs for ``policy``'s run: its submit times, the same work each."""
    return [
        Job(
            j.name,
            j.submit_s + j.master_start_s,  # it reaches the cluster when its master asks
            j.max_workers,
            solo_seconds(measured, j.max_workers, pace) * j.max_workers,
            measured.job_type,
            measured.global_batch,
        )
        for j in measured.jobs[policy]
    ]


@dataclass(frozen=True)
class Simulated:
    result: Result
    job_times: Mapping[str, tuple[float, float | None, float | None]]  # submit, first, end
    samples: list[Sample]  # slots held per job over time


def simulate_measured(
    measured: Measured,
    policy: str,
    costs: Costs | None = None,
    scaling: str | None = None,
    pace: str = "curve",
) -> Simulated:
    """Run ``policy`` over the measured jobs on ``measured.slots`` slots with the measured
    costs (or ``costs``), gang without an admission queue (see the module's docstring); with
    ``pace="measured"`` every job's work is scaled by :func:`pace_factor`."""
    if pace not in PACES:
        raise ValueError(f"unknown pace {pace!r}; known: {', '.join(PACES)}")
    jobs = jobs_of(measured, policy, pace)
    mins = {j.min_workers for j in measured.jobs[policy]}
    if policy == "elastic" and len(mins) > 1:
        raise ValueError(f"workload {measured.source}: elastic jobs with different min_workers")
    sim = Simulation(
        jobs,
        measured.slots,
        policy,
        costs or measured.costs[policy],
        scaling or ("linear" if measured.job_type is None else "pollux"),
        min_workers=mins.pop(),
        gpus_per_node=measured.slots,
        gang_queue=False,
        record=True,
    )
    result = sim.run()
    return Simulated(result, sim.job_times, samples_of(sim.holdings or []))


def samples_of(holdings: Sequence[tuple[float, str, int]]) -> list[Sample]:
    """Slots held per job, one sample per instant at which any changed (the last change of an
    instant wins)."""
    held: dict[str, int] = {}
    samples: list[Sample] = []
    for t, job, count in holdings:
        held[job] = count
        now = {k: v for k, v in held.items() if v}
        if samples and samples[-1].t == t:
            samples[-1] = Sample(t, now)
        else:
            samples.append(Sample(t, now))
    return samples


def relative_error(simulated: float, measured: float) -> float:
    """(simulated - measured) / measured; 0 when both are 0."""
    if measured == 0:
        return 0.0 if simulated == 0 else float("inf")
    return (simulated - measured) / measured


def compare(
    measured: Measured, simulated: Mapping[str, Simulated], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Per policy: the makespan and each job's JCT, simulated against measured, their relative
    error and whether it is within ``tolerance``; ``pass`` when every compared number is."""
    out: dict[str, Any] = {"tolerance": tolerance, "policies": {}}
    verdicts = []

    def row(sim: float, real: float | None) -> dict[str, Any] | None:
        if real is None:
            return None
        error = relative_error(sim, real)
        ok = abs(error) <= tolerance
        verdicts.append(ok)
        return {
            "simulated_s": round(sim, 2),
            "measured_s": round(real, 2),
            "error": round(error, 4),
            "pass": ok,
        }

    for policy, sim in simulated.items():
        jobs = {}
        for job in measured.jobs[policy]:
            _, first, end = sim.job_times[job.name]
            submit = job.submit_s
            jobs[job.name] = {
                "jct": row(end - submit, job.jct_s),  # type: ignore[operator]
                "pending": row(first - submit, job.first_step_s and job.first_step_s - submit),  # type: ignore[operator]
            }
        out["policies"][policy] = {
            "makespan": row(sim.result.makespan_s, measured.makespan_s[policy]),
            "utilization": {
                "simulated": round(sim.result.utilization, 4),
                "measured": measured.utilization[policy],
            },
            "jobs": jobs,
        }
    # pending times are shown, not judged: a job that starts at once has a relative error of
    # a few seconds over almost nothing
    judged = [
        r["pass"]
        for p in out["policies"].values()
        for r in [p["makespan"], *(j["jct"] for j in p["jobs"].values())]
        if r is not None
    ]
    out["pass"] = bool(judged) and all(judged)
    return out


def comparison_lines(comparison: Mapping[str, Any]) -> list[str]:
    """The comparison as a table to print."""
    lines = [
        f"{'policy':<8} {'what':<16} {'simulated s':>12} {'measured s':>11} {'error':>8}  verdict"
    ]

    def line(policy: str, what: str, r: Mapping[str, Any] | None, judged: bool = True) -> None:
        if r is None:
            lines.append(f"{policy:<8} {what:<16} {'':>12} {'(not measured)':>11}")
            return
        verdict = ("PASS" if r["pass"] else "FAIL") if judged else "(shown)"
        lines.append(
            f"{policy:<8} {what:<16} {r['simulated_s']:>12.1f} {r['measured_s']:>11.1f} "
            f"{r['error']:>+8.1%}  {verdict}"
        )

    for policy, p in comparison["policies"].items():
        line(policy, "makespan", p["makespan"])
        for name, j in p["jobs"].items():
            line(policy, f"{name} JCT", j["jct"])
            line(policy, f"{name} pending", j["pending"], judged=False)
        u = p["utilization"]
        lines.append(
            f"{policy:<8} {'utilization':<16} {u['simulated']:>12.3f} "
            f"{u['measured'] if u['measured'] is not None else '-':>11}"
        )
    tolerance = comparison["tolerance"]
    verdict = "PASS" if comparison["pass"] else "FAIL"
    lines.append(f"{verdict}: every makespan and JCT within {tolerance:.0%} of the measured one")
    return lines
