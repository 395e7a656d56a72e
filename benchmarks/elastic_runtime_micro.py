"""The micro part of ``benchmarks/elastic_runtime.py``: in-process costs of a snapshot (its
synchronous and background parts), the training slow-down while the background part runs, and
Progress.commit's cost against the number of epochs."""

from __future__ import annotations

import argparse
import importlib
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.elastic_runtime_common import (
    BATCH,
    MODELS,
    TRAIN_SAMPLES,
    steps_per_epoch,
)
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd
from kfp_elastic.rendezvous.local_agents import new_run_id


def bench_micro(args: argparse.Namespace, etcd: EmbeddedEtcd, work_dir: Path) -> dict[str, Any]:
    import torch

    from kfp_elastic.etcd.client import connect
    from kfp_elastic.worker import snapshot_format
    from kfp_elastic.worker.data_plan import shards_for_length
    from kfp_elastic.worker.progress import Committed, Progress, manifest_from_shards
    from kfp_elastic.worker.snapshot import Snapshotter

    torch.set_num_threads(1)
    model_def = importlib.import_module(MODELS[args.model])
    # --device cuda: the state lives on the GPU and save() copies it into pinned host memory.
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = model_def.model().to(device)
    optimizer = model_def.optimizer(model.parameters())
    features, labels = (t.to(device) for t in model_def.dataset("train")[:BATCH])

    def train_step() -> None:
        loss = model_def.loss(model, [features, labels])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(20):
        train_step()  # momentum buffers exist, caches warm

    def state() -> dict[str, Any]:  # what Trainer._commit builds on the training thread
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": 1,
            "epoch": 0,
            "position": 0,
            "rng": torch.get_rng_state(),
        }

    def settle() -> None:
        """Wait for the GPU's queued work: a clock read before it times only the queueing."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            settle()
            began = time.perf_counter()
            fn()
            settle()
            out.append(time.perf_counter() - began)
        return out

    n = args.micro_n
    snapshotter = Snapshotter(work_dir / "micro-snapshots")
    save_times = []
    for step in range(n):
        settle()
        began = time.perf_counter()
        snapshotter.save(step, state(), lambda name: None)  # _commit's synchronous part
        settle()
        save_times.append(time.perf_counter() - began)
        snapshotter.wait()  # the background part, not timed here
    cpu = state()
    packed = snapshot_format.pack(cpu)

    def pack_reused() -> None:
        snapshot_format.pack(cpu, packed.buffer)

    def write_packed() -> None:
        packed._header = None  # the checksum is part of the writer's work
        packed.write_to(work_dir / "micro.snap")

    def steps_after(on_persisted: Any) -> float:
        """Seconds for 10 train steps right after save() (background write under way)."""
        snapshotter.save(0, state(), on_persisted)
        settle()
        began = time.perf_counter()
        for _ in range(10):
            train_step()
        settle()
        spent = time.perf_counter() - began
        snapshotter.wait()
        return spent

    def thread_start() -> None:
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()

    noop_commit = lambda name: None  # noqa: E731
    results = {
        "train_step_1proc_ms": statistics.median(timed(train_step, n)) * 1e3,
        "state_build_ms": statistics.median(timed(state, n)) * 1e3,
        "pack_copy_ms": statistics.median(timed(pack_reused, n)) * 1e3,
        "sync_save_call_ms": statistics.median(save_times) * 1e3,  # incl. state build
        "packed_write_ms": statistics.median(timed(write_packed, n)) * 1e3,
        "state_bytes": (work_dir / "micro.snap").stat().st_size,
        "torch_save_ms": statistics.median(
            timed(lambda: torch.save(cpu, work_dir / "micro.pt"), max(5, n // 5))
        )
        * 1e3,
        "thread_start_join_ms": statistics.median(timed(thread_start, n)) * 1e3,
        "ten_steps_ms": statistics.median(
            timed(lambda: [train_step() for _ in range(10)], max(5, n // 5))
        )
        * 1e3,
        "ten_steps_after_save_noop_commit_ms": statistics.median(
            [steps_after(noop_commit) for _ in range(max(5, n // 5))]
        )
        * 1e3,
    }
    client = connect(etcd.client_settings())
    try:
        shards = shards_for_length(TRAIN_SAMPLES, max(1, TRAIN_SAMPLES // 64))
        for epochs in sorted({1, 10, args.epochs, 100}):
            progress = Progress(client, f"/kfp-elastic/micro-{new_run_id()}")
            manifest = manifest_from_shards(shards, epochs)
            previous: Committed | None = None
            revision = 0
            per_epoch = steps_per_epoch(2)
            times = []
            for i in range(1, max(5, n // 10) + 1):
                step = i * 10
                new = Committed(
                    step,
                    (step // per_epoch) % epochs,
                    (step % per_epoch) * 2 * BATCH,
                    "snapshot",
                    2,
                )
                began = time.perf_counter()
                revision = progress.commit(manifest, previous, revision, new)
                times.append(time.perf_counter() - began)
                assert revision
                previous = new
            one_epoch = range(previous.epoch, previous.epoch + 1)
            placement = timed(
                lambda p=progress, m=manifest, c=previous, e=one_epoch: p._placement(m, c, e),
                max(5, n // 10),
            )
            results[f"progress_commit_ms_epochs{epochs}"] = statistics.median(times) * 1e3
            results[f"placement_ms_epochs{epochs}"] = statistics.median(placement) * 1e3
            if epochs == args.epochs:  # the background part as the throughput jobs run it

                def real_commit(
                    name: str, p: Progress = progress, m: Any = manifest, per_epoch: int = per_epoch
                ) -> None:
                    nonlocal previous, revision
                    step = (previous.step if previous else 0) + 10
                    new = Committed(
                        step,
                        (step // per_epoch) % m.epochs,
                        (step % per_epoch) * 2 * BATCH,
                        name,
                        2,
                    )
                    revision = p.commit(m, previous, revision, new)
                    assert revision
                    previous = new

                results["ten_steps_after_save_etcd_commit_ms"] = (
                    statistics.median([steps_after(real_commit) for _ in range(max(5, n // 5))])
                    * 1e3
                )
        results["shards"] = len(shards)
    finally:
        client.close()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
