"""The form scenario of ``benchmarks/rendezvous_recovery.py``: N rendezvous handlers call
next_rendezvous() at the same moment; seconds until all N returned."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from benchmarks.rendezvous_recovery_common import Backend, Run
from kfp_elastic.rendezvous.local_agents import new_run_id


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
    from benchmarks import etcd_traffic
    from benchmarks.form_processes import form_round_processes

    run_id = new_run_id(f"form{size}-{backend.spec.name}")
    run = Run(scenario=f"form{size}", run_id=run_id)
    scrapes: dict[str, dict[str, float]] = {}

    def checkpoint(phase: str) -> None:
        if backend.spec.name == "elastic-etcd":  # the others' etcd traffic is not comparable
            with contextlib.suppress(OSError):
                scrapes[phase] = etcd_traffic.scrape(backend.endpoint())

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
            "until_returned": etcd_traffic.per_node(scrapes["go"], scrapes["returned"], size),
            "until_settled": etcd_traffic.per_node(scrapes["go"], scrapes["settled"], size),
        }
    return run


def _rank(info: Any) -> int:
    return info.rank if hasattr(info, "rank") else info[1]  # RendezvousInfo or an old tuple
