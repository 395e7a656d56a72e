"""How fast do torchrun rendezvous backends recover from a lost node and absorb a new one?

    python -m benchmarks rendezvous [--repeats 5] [--backends elastic-etcd,c10d,etcd-v2]
                                    [--sizes 8,32,128] [--quick] [--out FILE]

Per backend, on local processes (one torchrun agent with one gloo worker = one "node", running
examples/tiny_ddp.py):

kill   3 agents with --nnodes=2:3 train in a 3-node world; SIGKILL the whole process tree of one
       non-first node; seconds from the kill to the first training step of the 2-node world.
join   2 agents with --nnodes=2:3 train; launch a 3rd; seconds from its launch to the first step
       of the 3-node world. Also measured, as a reference: a fresh python importing torch +
       torch._dynamo (what a cold worker process of the new node would need before a step).
form   N handlers (registry.get_rendezvous_handler, min=max=N) spread over --form-processes
       processes (default 8; benchmarks/form_processes.py), each calling next_rendezvous() in
       its own thread at the same moment; seconds until all N returned.

Each kill/join run uses a fresh run id and fresh agents and counts as recovered when it reached the
target world within --cap seconds. Prints medians and the ratios elastic-etcd / c10d and writes
all runs as JSON (see ``benchmarks/harness.py``). Every agent, worker and etcd started here is
killed on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.form_processes import form_round_processes
from benchmarks.harness import (
    add_common_options,
    comma_list,
    first_after,
    median,
    parse_options,
    run_in_work_dir,
    start_etcd,
    write_result,
)
from kfp_elastic.etcd.embedded import EmbeddedEtcd, free_port
from kfp_elastic.testing.nodes import (
    AGENT,
    TORCHRUN,
    AgentGroup,
    first_step_with_world,
    new_run_id,
    read_events,
    tiny_ddp_args,
    wait_for_events,
)

# --------------------------------------------------------------------------- backends and runs


@dataclass(frozen=True)
class BackendSpec:
    name: str
    etcd: str | None  # None, "v3" or "v2": which embedded etcd the backend needs
    disable_shared_store: bool  # set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the agents
    note: str = ""


BACKENDS: dict[str, BackendSpec] = {
    "elastic-etcd": BackendSpec("elastic-etcd", "v3", False, "this project's etcd-v3 backend"),
    "c10d": BackendSpec(
        "c10d",
        None,
        True,
        "first agent hosts the TCPStore (is_host=1; killing it kills the job, so never the "
        "victim); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without it a new round's workers time "
        "out on the shared store; dead peers are dropped after 3 missed 5 s heartbeats",
    ),
    "etcd-v2": BackendSpec(
        "etcd-v2",
        "v2",
        True,
        "torch's etcd-v2 backend on etcd 3.5 --enable-v2 (v2 API removed in etcd 3.6)",
    ),
}


@dataclass
class Run:
    scenario: str
    run_id: str
    recovered: bool = False
    seconds: float | None = None  # event -> first step of the target world
    worker_start_s: float | None = None  # event -> first worker "start" in the target world
    restart_counts: list[int] = field(default_factory=list)  # TORCHELASTIC_RESTART_COUNT after
    victim_group_rank: int | None = None
    event_t: float | None = None  # time.time() of the kill or the launch
    # From the agents' logs (LOGLEVEL=INFO), seconds after the event, best effort:
    worker_failed_s: float | None = None  # first surviving worker reported failed
    rendezvous_done_s: float | None = None  # first "Rendezvous complete" of the new round
    # join, elastic-etcd: the new node registered in etcd (its agent has imported torch)
    registered_s: float | None = None
    error: str | None = None
    elapsed_s: float | None = None  # form: from the start until all returned, failed or not
    logs: str | None = None  # agent log tails, only for runs that failed
    # form, elastic-etcd: etcd requests / stream messages / watch messages / bytes per node
    etcd_per_node: dict[str, dict[str, float]] | None = None


_LOG_TIME = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+) ")


def log_times(text: str, needle: str, year: int) -> list[float]:
    """time.time() values of torchrun log lines ("I1121 12:56:26.440000 ...") containing needle."""
    found = []
    for line in text.splitlines():
        match = _LOG_TIME.match(line)
        if match and needle in line:
            stamp = datetime.strptime(f"{year}{match.group(1)}", "%Y%m%d %H:%M:%S.%f")
            found.append(stamp.timestamp())
    return found


_PLUGIN_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\] elastic-etcd ")


def plugin_log_times(text: str, needle: str) -> list[float]:
    """time.time() values of this project's log lines ("[2026-11-21 21:13:41,092] elastic-etcd
    INFO ...") containing needle."""
    found = []
    for line in text.splitlines():
        match = _PLUGIN_TIME.match(line)
        if match and needle in line:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            found.append(stamp.timestamp())
    return found


def summarize(runs: list[Run], cap: float) -> dict[str, Any]:
    seconds = [r.seconds for r in runs if r.recovered and r.seconds is not None]
    traffic = [r.etcd_per_node for r in runs if r.recovered and r.etcd_per_node]
    medians = (
        {
            phase: {key: median([t[phase][key] for t in traffic]) for key in traffic[0][phase]}
            for phase in traffic[0]
        }
        if traffic
        else None
    )
    return {
        "etcd_per_node_median": medians,
        "median_s": median(seconds),
        "min_s": min(seconds) if seconds else None,
        "max_s": max(seconds) if seconds else None,
        "recovered": len(seconds),
        "runs": len(runs),
        "cap_s": cap,
        "details": [asdict(r) for r in runs],
    }


class Backend:
    """A backend with what it needs running (an embedded etcd, or nothing for c10d)."""

    def __init__(
        self,
        spec: BackendSpec,
        stack: contextlib.ExitStack,
        work_dir: Path,
        extra_conf: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.extra_conf: dict[str, str] = dict(extra_conf or {})
        self.etcd: EmbeddedEtcd | None = None
        if spec.etcd:
            self.etcd = start_etcd(
                stack, work_dir, f"etcd-{spec.name}", enable_v2=spec.etcd == "v2"
            )

    def endpoint(self) -> str:
        """The endpoint for a new run (c10d: a fresh port, hosted by the first agent)."""
        return self.etcd.endpoint if self.etcd else f"127.0.0.1:{free_port()}"

    def agent_conf(self, index: int, last_call_timeout: int) -> dict[str, object]:
        conf: dict[str, object] = {"last_call_timeout": last_call_timeout}
        if self.spec.name == "c10d":
            conf["is_host"] = 1 if index == 0 else 0
        return {**conf, **self.extra_conf}

    def handler_conf(self, index: int, timeout: float) -> dict[str, object]:
        conf: dict[str, object] = {"join_timeout": int(timeout)}
        if self.spec.name == "c10d":
            conf["is_host"] = index == 0
        return {**conf, **self.extra_conf}


def check_available(name: str) -> str | None:
    """Why the backend cannot run here, or None."""
    if name == "elastic-etcd":
        try:
            from kfp_elastic.rendezvous.plugin import entry_point  # noqa: F401
        except Exception as error:  # noqa: BLE001
            return f"rendezvous.plugin not importable: {type(error).__name__}: {error}"
    if name == "etcd-v2":
        try:
            import etcd  # type: ignore[import-untyped]  # noqa: F401
        except ImportError:
            return "python-etcd (module `etcd`) is not installed: pip install python-etcd"
    return None


# What a new node's worker would import, one after the other, if started cold: torch (torchrun's
# agent imports it too), then torch._dynamo for DDP's constructor. The join is compared to it.
COLD_IMPORT_REFERENCE_CODE = "import torch.distributed.run, torch.nn.parallel, torch._dynamo"


def cold_import_reference(repeats: int) -> dict[str, Any]:
    """Seconds from ``python`` starting to its import of torch + torch._dynamo done (median)."""
    import subprocess
    import time

    times = []
    for _ in range(max(1, repeats)):
        started = time.monotonic()
        # os._exit: the interpreter's teardown of torch (≈ 0.5 s) is not part of a start.
        code = COLD_IMPORT_REFERENCE_CODE + "; import os; os._exit(0)"
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times.append(round(time.monotonic() - started, 3))
    return {"code": COLD_IMPORT_REFERENCE_CODE, "runs_s": times, "median_s": median(times)}


# --------------------------------------------------------------------------- kill and join

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


# --------------------------------------------------------------------------- form


def form_round(backend: Backend, size: int, timeout: float) -> Run:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    run_id = new_run_id(f"form{size}-{backend.spec.name}")
    run = Run(scenario=f"form{size}", run_id=run_id)
    endpoint = backend.endpoint()
    if backend.spec.disable_shared_store:  # as for the agents: rank 0 hosts no extra TCPStore
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    handlers: list[Any] = []
    results: dict[int, tuple[float, Any]] = {}
    errors: list[str] = []
    barrier = threading.Barrier(size + 1)
    started: list[float] = []

    def join(index: int) -> None:
        barrier.wait()
        try:
            info = handlers[index].next_rendezvous()
            results[index] = (time.monotonic(), info)
        except Exception as error:  # noqa: BLE001
            errors.append(f"{type(error).__name__}: {error}")

    try:
        for index in range(size):
            params = RendezvousParameters(
                backend=backend.spec.name,
                endpoint=endpoint,
                run_id=run_id,
                min_nodes=size,
                max_nodes=size,
                **backend.handler_conf(index, timeout),
            )
            handlers.append(get_rendezvous_handler(params))
        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(size)]
        for thread in threads:
            thread.start()
        started.append(time.monotonic())
        barrier.wait()
        deadline = time.monotonic() + timeout + 5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        run.elapsed_s = round(time.monotonic() - started[0], 3)
        if len(results) == size:
            ranks = sorted(_rank(info) for _, info in results.values())
            if ranks != list(range(size)):
                run.error = f"ranks {ranks} are not 0..{size - 1}"
            else:
                run.recovered = True
                run.seconds = round(max(t for t, _ in results.values()) - started[0], 3)
        else:
            run.error = (
                f"{len(results)}/{size} joined after {run.elapsed_s} s;"
                f" errors: {sorted(set(errors))[:3]}"
            )
    except Exception as error:  # noqa: BLE001
        run.error = f"{type(error).__name__}: {error}"
    finally:
        for handler in handlers:
            with contextlib.suppress(Exception):
                handler.shutdown()
    return run


def form_round_in_processes(backend: Backend, size: int, timeout: float, processes: int) -> Run:
    run_id = new_run_id(f"form{size}-{backend.spec.name}")
    run = Run(scenario=f"form{size}", run_id=run_id)
    scrapes: dict[str, dict[str, float]] = {}

    def checkpoint(phase: str) -> None:
        if backend.spec.name == "elastic-etcd":  # the others' etcd traffic is not comparable
            with contextlib.suppress(OSError):
                scrapes[phase] = scrape(backend.endpoint())

    seconds, error = form_round_processes(
        backend.spec.name,
        backend.endpoint(),
        run_id,
        size,
        {i: backend.handler_conf(i, timeout) for i in range(size)},
        processes,
        timeout,
        backend.spec.disable_shared_store,
        checkpoint,
    )
    run.recovered, run.seconds, run.error = seconds is not None, seconds, error
    if {"go", "returned", "settled"} <= scrapes.keys():
        run.etcd_per_node = {
            "until_returned": per_node(scrapes["go"], scrapes["returned"], size),
            "until_settled": per_node(scrapes["go"], scrapes["settled"], size),
        }
    return run


def _rank(info: Any) -> int:
    return info.rank if hasattr(info, "rank") else info[1]  # RendezvousInfo or an old tuple


# --------------------------------------------------------------------------- etcd traffic
# How much each node asks of etcd while a round forms, from etcd's own ``/metrics``. Seconds on
# one 2-core machine add up every simulated node's CPU; the requests and watch messages per node
# do not depend on the machine. A protocol whose per-node counts stay flat from N = 8 to N = 128
# forms a round in about the same time on N hosts, whatever one shared machine shows. Counted
# from etcd's gRPC server metrics (``--metrics=basic``, etcd's default):
# - ``requests``: unary calls handled (Range, Put, Txn, LeaseGrant, LeaseRevoke, ...)
# - ``stream_messages_in``: messages received on streams (watch creates/cancels, keepalives)
# - ``watch_messages_out``: watch responses sent (each may carry several events)
# - ``bytes_out``: bytes etcd sent to clients (a read of all N records shows up here)

_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")


def scrape(endpoint: str, timeout: float = 5.0) -> dict[str, float]:
    """Totals of the counters above for the etcd serving ``endpoint`` (``HOST:PORT``)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    totals = {
        "requests": 0.0,
        "stream_messages_in": 0.0,
        "watch_messages_out": 0.0,
        "bytes_out": 0.0,
    }
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            if line.startswith("etcd_network_client_grpc_sent_bytes_total "):
                totals["bytes_out"] += float(line.split()[-1])
            continue
        name, labels, value = match["name"], match["labels"], float(match["value"])
        if name == "grpc_server_handled_total" and 'grpc_type="unary"' in labels:
            totals["requests"] += value
        elif name == "grpc_server_msg_received_total" and 'grpc_type="unary"' not in labels:
            totals["stream_messages_in"] += value
        elif name == "grpc_server_msg_sent_total" and 'grpc_method="Watch"' in labels:
            totals["watch_messages_out"] += value
    return totals


def per_node(before: dict[str, float], after: dict[str, float], nodes: int) -> dict[str, float]:
    """What the ``nodes`` nodes cost etcd between two scrapes, per node."""
    return {key: round((after[key] - before[key]) / max(1, nodes), 2) for key in before}


# --------------------------------------------------------------------------- main


def bench_backend(
    spec: BackendSpec, args: argparse.Namespace, work_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    result: dict[str, Any] = {"note": spec.note, "status": "ok"}
    reason = check_available(spec.name)
    if reason:
        print(f"[{spec.name}] skipped: {reason}", flush=True)
        return {**result, "status": "skipped", "reason": reason}
    try:
        extra = args.elastic_conf if spec.name == "elastic-etcd" else {}
        backend = Backend(spec, stack, work_dir, extra)
    except Exception as error:  # noqa: BLE001
        reason = f"could not start its etcd: {type(error).__name__}: {error}"
        print(f"[{spec.name}] skipped: {reason}", flush=True)
        return {**result, "status": "skipped", "reason": reason}
    result["disable_shared_store"] = spec.disable_shared_store
    for scenario in [s for s in ("kill", "join") if s in args.scenarios]:
        runs = []
        for repeat in range(args.repeats):
            run = run_agents_scenario(backend, scenario, args, work_dir)
            runs.append(run)
            shown = f"{run.seconds:.2f} s" if run.recovered else f"FAILED ({run.error})"
            if run.recovered and run.registered_s is not None:
                shown += (
                    f" ({run.seconds - run.registered_s:.2f} s after the new node"
                    f" registered at {run.registered_s:.2f} s)"
                )
            print(
                f"[{spec.name}] {scenario} {repeat + 1}/{args.repeats}: {shown}"
                f" (worker failed {run.worker_failed_s}, rendezvous {run.rendezvous_done_s},"
                f" worker start {run.worker_start_s}) restart_counts={run.restart_counts}",
                flush=True,
            )
        result[scenario] = summarize(runs, args.cap)
    gave_up_at: int | None = None
    for size in args.sizes if "form" in args.scenarios else []:
        if gave_up_at is not None:
            result[f"form{size}"] = {"skipped": f"N={gave_up_at} did not form within the cap"}
            print(f"[{spec.name}] form N={size}: skipped, N={gave_up_at} failed", flush=True)
            continue
        runs = []
        for repeat in range(args.repeats):
            if args.form_processes > 1:
                run = form_round_in_processes(backend, size, args.form_cap, args.form_processes)
            else:
                run = form_round(backend, size, args.form_cap)
            runs.append(run)
            shown = f"{run.seconds:.2f} s" if run.recovered else f"FAILED ({run.error})"
            print(f"[{spec.name}] form N={size} {repeat + 1}/{args.repeats}: {shown}", flush=True)
            if not run.recovered:  # larger rounds and more repeats would only time out too
                gave_up_at = size
                break
        result[f"form{size}"] = summarize(runs, args.form_cap)
    if backend.etcd:
        backend.etcd.stop()
    return result


def print_table(results: dict[str, Any], sizes: list[int]) -> dict[str, float | None]:
    rows = [
        row
        for row in ("kill", "join", *(f"form{n}" for n in sizes))
        if any(row in data for data in results.values())
    ]
    names = list(results)
    ratios: dict[str, float | None] = {}
    header = f"{'median seconds':<16}" + "".join(f"{n:>18}" for n in names)
    if "elastic-etcd" in names and "c10d" in names:
        header += f"{'elastic/c10d':>14}"
    print("\n" + header)
    for row in rows:
        line = f"{row:<16}"
        for name in names:
            data = results[name].get(row)
            if not data or "runs" not in data:
                line += f"{'-':>18}"
                continue
            med = data["median_s"]
            cell = f"{med:.2f}" if med is not None else "n/a"
            cell += f" ({data['recovered']}/{data['runs']})"
            line += f"{cell:>18}"
        if "elastic-etcd" in names and "c10d" in names:
            ours = (results["elastic-etcd"].get(row) or {}).get("median_s")
            theirs = (results["c10d"].get(row) or {}).get("median_s")
            ratios[row] = round(ours / theirs, 3) if ours and theirs else None
            line += f"{ratios[row] if ratios[row] is not None else '-':>14}"
        print(line)
    print("(k/n) = runs that reached the target world within the cap\n")
    return ratios


def print_join_reference(results: dict[str, Any], reference: dict[str, Any]) -> None:
    """The join against a cold worker's imports, measured in this run."""
    print(
        f"join reference: a fresh python importing torch + torch._dynamo (what a cold worker "
        f"of the new node needs before its first step) takes {reference['median_s']:.2f} s here "
        f"(median of {len(reference['runs_s'])})"
    )
    for name, data in results.items():
        join = (data.get("join") or {}).get("median_s")
        if join and reference["median_s"]:
            ratio = join / reference["median_s"]
            print(f"  {name}: join {join:.2f} s = {ratio:.2f} x the reference")
        after = [
            d["seconds"] - d["registered_s"]
            for d in (data.get("join") or {}).get("details", [])
            if d.get("recovered") and d.get("registered_s") is not None
        ]
        if after:
            print(
                f"  {name}: from the new node's registration to the first step: "
                f"{statistics.median(after):.2f} s median ({min(after):.2f}-{max(after):.2f})"
            )
    print()


def print_form_traffic(result: dict[str, Any], sizes: list[int]) -> None:
    """etcd's work per node while a round forms: flat in N means flat time on N hosts."""
    rows = [(n, (result.get(f"form{n}") or {}).get("etcd_per_node_median")) for n in sizes]
    rows = [(n, traffic) for n, traffic in rows if traffic]
    if not rows:
        return
    print("elastic-etcd, etcd's work per node while the round forms (from etcd's /metrics):")
    print(
        f"{'N':>5} {'phase':<15}{'requests':>10}{'stream in':>11}{'watch out':>11}{'bytes out':>11}"
    )
    for size, traffic in rows:
        for phase, counts in traffic.items():
            print(
                f"{size:>5} {phase:<15}{counts['requests']:>10.1f}"
                f"{counts['stream_messages_in']:>11.1f}{counts['watch_messages_out']:>11.1f}"
                f"{counts['bytes_out']:>11.0f}"
            )
    print()


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks rendezvous``'s options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks rendezvous",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="elastic-etcd,c10d,etcd-v2")
    parser.add_argument("--sizes", default="8,32,128", help="round sizes N for `form`")
    parser.add_argument("--scenarios", default="kill,join,form", help="a subset of these")
    add_common_options(parser, "--repeats 1 --sizes 8")
    parser.add_argument("--cap", type=float, default=60.0, help="recovery cap per run, seconds")
    parser.add_argument("--form-cap", type=float, default=120.0, help="cap per `form` run")
    parser.add_argument(
        "--form-processes",
        type=int,
        default=8,
        help="spread the N handlers of `form` over this many processes "
        "(1: all in this process, one thread each)",
    )
    parser.add_argument("--last-call-timeout", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument(
        "--shared-store",
        action="store_true",
        help="torch's default for every backend: leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset",
    )
    parser.add_argument(
        "--elastic-conf",
        default="",
        help="extra --rdzv-conf for elastic-etcd only (agents and form), e.g. lease_ttl=10",
    )
    parser.add_argument(
        "--elastic-launcher",
        choices=("agent", "torchrun"),
        default="agent",
        help="what starts elastic-etcd's agents: `kfp-elastic agent` (what the master runs) or "
        "plain torchrun (a user's own command); other backends always run plain torchrun",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work dir")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.repeats, args.sizes = 1, "8"
    args.backends = comma_list(args.backends)
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backends {unknown}; known: {list(BACKENDS)}")
    args.elastic_conf = dict(
        item.split("=", 1) for item in comma_list(args.elastic_conf) if "=" in item
    )
    args.scenarios = comma_list(args.scenarios)
    args.sizes = [int(s) for s in comma_list(args.sizes)]
    return args


def headline(results: dict[str, Any], ratios: dict[str, float | None]) -> dict[str, Any]:
    """Per backend and scenario the median seconds (and runs recovered), and elastic/c10d."""
    summary: dict[str, Any] = {}
    for name, data in results.items():
        for row, measured in data.items():
            if isinstance(measured, dict) and "runs" in measured:
                summary[f"{name}.{row}.median_s"] = measured["median_s"]
                summary[f"{name}.{row}.recovered"] = f"{measured['recovered']}/{measured['runs']}"
        if data.get("status") == "skipped":
            summary[f"{name}.skipped"] = data["reason"]
    summary.update({f"elastic_over_c10d.{row}": ratio for row, ratio in ratios.items()})
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    began = time.time()

    def body(work_dir: Path, stack: contextlib.ExitStack) -> None:
        for name in args.backends:
            spec = BACKENDS[name]
            if args.shared_store:
                spec = replace(spec, disable_shared_store=False)
            results[name] = bench_backend(spec, args, work_dir, stack)

    code, work_dir = run_in_work_dir("rdzv-bench-", args.keep_logs, body)
    reference = cold_import_reference(args.repeats) if "join" in args.scenarios else None
    ratios = print_table(results, args.sizes)
    if reference is not None:
        print_join_reference(results, reference)
    print_form_traffic(results.get("elastic-etcd", {}), args.sizes)
    report = {
        "setup": {
            "repeats": args.repeats,
            "sizes": args.sizes,
            "cap_s": args.cap,
            "form_cap_s": args.form_cap,
            "nnodes": "2:3",
            "nproc_per_node": 1,
            "max_restarts": 10,
            "monitor_interval": 0.2,
            "last_call_timeout": args.last_call_timeout,
            "step_time": args.step_time,
            "shared_store": args.shared_store,
            "elastic_conf": args.elastic_conf,
            "elastic_launcher": args.elastic_launcher,
            "settle_s": SETTLE_S,
            "form": (
                f"handlers in {args.form_processes} processes, one thread each, "
                "min_nodes=max_nodes=N"
            ),
        },
        "results": results,
        "ratios_elastic_etcd_over_c10d": ratios,
        "join_cold_import_reference": reference,
    }
    if args.keep_logs:
        print(f"logs kept in {work_dir}")
    write_result("rendezvous", args, began, code == 0, headline(results, ratios), report)
    return code
