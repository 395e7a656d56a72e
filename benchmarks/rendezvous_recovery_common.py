"""Shared pieces of ``benchmarks/rendezvous_recovery.py``: the backends under test (and what
each needs running), one measured run, its summary and the torchrun log-time helpers."""

from __future__ import annotations

import contextlib
import re
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd, free_port


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


def first_after(times: list[float], after: float) -> float | None:
    later = [t - after for t in times if t > after]
    return round(min(later), 3) if later else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


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
            self.etcd = EmbeddedEtcd(
                enable_v2=spec.etcd == "v2",
                data_dir=work_dir / f"etcd-{spec.name}",
                log_file=work_dir / f"etcd-{spec.name}.log",
            )
            stack.callback(self.etcd.stop)
            self.etcd.start()

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
    import sys
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
