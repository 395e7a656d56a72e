"""Device choice, backend choice and the stall abort (worker/device.py): the decisions are pure
and run without a GPU; the abort's signal path runs for real in a gloo collective whose peer is
stopped (the state a NCCL rank is in when its peer died)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kfp_elastic.contract.nccl_env import (
    NCCL_ERROR_HANDLING_ENV,
    nccl_error_handling_not_set,
    nccl_error_handling_override,
    set_nccl_error_handling,
)
from kfp_elastic.etcd.embedded import free_port
from kfp_elastic.worker.device import (
    CollectiveAborted,
    DeviceError,
    StallAbort,
    backend_for,
    choose_device,
    explain_device,
    settle,
    stall_is_abortable,
    to_device,
)
from tests.helpers import REPO_ROOT


@pytest.mark.parametrize(
    ("requested", "local_rank", "accelerator", "count", "expected"),
    [
        ("auto", 0, None, 0, torch.device("cpu")),
        ("auto", 3, "cuda", 8, torch.device("cuda", 3)),
        ("cpu", 1, "cuda", 8, torch.device("cpu")),
        ("cuda", 1, "cuda", 2, torch.device("cuda", 1)),
    ],
)
def test_each_local_rank_gets_its_own_device(
    requested: str, local_rank: int, accelerator: str | None, count: int, expected: torch.device
) -> None:
    assert choose_device(requested, local_rank, accelerator, count) == expected


def test_auto_never_takes_the_cpu_quietly_where_the_driver_lists_gpus() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    level, line = explain_device("auto", cpu, None, 0, driver_gpus=2)
    assert level == logging.WARNING and "the NVIDIA driver lists 2 GPU(s)" in line
    assert "torch sees no GPU" in line and "--device cuda" in line
    assert explain_device("auto", cpu, None, 0, 0) == (
        logging.INFO,
        "device=cpu (--device auto: torch sees no GPU and the driver lists no GPU)",
    )
    assert explain_device("auto", gpu, "cuda", 2, 2) == (
        logging.INFO,
        "device=cuda:1 (--device auto: torch sees 2 cuda device(s))",
    )
    assert explain_device("cpu", cpu, "cuda", 2, 2)[0] == logging.INFO  # asked for


@pytest.mark.parametrize(
    ("requested", "local_rank", "accelerator", "count", "message"),
    [
        ("cuda", 0, None, 0, "no cuda device visible"),
        ("cuda", 0, "xpu", 1, "no cuda device visible"),
        ("auto", 2, "cuda", 2, "LOCAL_RANK=2 but only 2 cuda device"),
        ("tpu", 0, None, 0, "--device must be one of auto, cpu, cuda"),
    ],
)
def test_an_unusable_device_says_why(
    requested: str, local_rank: int, accelerator: str | None, count: int, message: str
) -> None:
    with pytest.raises(DeviceError, match=message):
        choose_device(requested, local_rank, accelerator, count)


def test_the_backend_follows_the_device() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"  # NCCL takes device tensors only
    with pytest.raises(DeviceError, match="meta"):
        backend_for(torch.device("meta"))


def test_batches_on_the_cpu_are_left_as_they_are() -> None:
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    assert to_device(batch, torch.device("cpu")) is batch


@pytest.mark.parametrize(
    ("now", "stop_at", "progress_at", "abort"),
    [
        (100.0, None, 0.0, False),  # no stop signal: a slow collective is the timeout's business
        (104.0, 100.0, 90.0, False),  # within the grace
        (105.0, 100.0, 90.0, True),  # no step since the stop signal for the grace: stuck
        (105.0, 100.0, 102.0, False),  # steps still finish: the agreed stop is coming
        (107.0, 100.0, 102.0, True),  # ... until they stop finishing
    ],
)
def test_a_stall_after_a_stop_signal_is_aborted_after_the_grace(
    now: float, stop_at: float | None, progress_at: float, abort: bool
) -> None:
    assert stall_is_abortable(now, stop_at, progress_at, grace_s=5.0) is abort


RANK = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from kfp_elastic.worker.device import StallAbort

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a peer that never takes part again
    signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer's: only sets a flag
    StallAbort(0.5, lambda: os._exit(42))  # stands in for aborting the NCCL communicator
    print("blocked", flush=True)
    dist.all_reduce(tensor)  # blocks in C: no Python runs on this thread
    sys.exit(1)
    """
)


def test_sigterm_reaches_the_abort_while_the_main_thread_is_blocked_in_a_collective(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        assert ranks[0].stdout is not None
        assert ranks[0].stdout.readline().strip() == "blocked"
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(30) == 42
    finally:
        for process in ranks:
            process.kill()
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()


def test_an_abort_is_visible_to_the_training_thread_before_the_optimizer_step() -> None:
    aborted = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer installs one
    stall = StallAbort(0.0, aborted.set)
    try:
        settle(torch.device("cpu"), stall)  # nothing aborted: the step goes on
        os.kill(os.getpid(), signal.SIGTERM)
        assert aborted.wait(10)
        with pytest.raises(CollectiveAborted):
            settle(torch.device("cpu"), stall)
    finally:
        stall.close()
        signal.signal(signal.SIGTERM, previous)


class FakeClock:
    """Monotonic seconds the test sets; ``wait_reads(n)`` returns once the watcher has read
    the clock ``n`` more times, i.e. has decided again on the time the test set."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._reads = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self._reads += 1
            self._changed.notify_all()
            return self.now

    def wait_reads(self, count: int = 3) -> None:
        with self._changed:
            target = self._reads + count
            assert self._changed.wait_for(lambda: self._reads >= target, timeout=30)


def test_a_broken_round_aborts_a_stalled_collective_without_any_sigterm() -> None:
    clock, aborted = FakeClock(), threading.Event()
    stall = StallAbort(5.0, aborted.set, clock=clock, poll_s=0.001)
    try:
        clock.now += 600  # no stop signal: however long it takes, nothing is aborted
        clock.wait_reads()
        assert not aborted.is_set()
        stall.round_broken("participant(s) lost: node-b")
        clock.now += 4.9  # within the grace
        clock.wait_reads()
        assert not aborted.is_set()
        clock.now += 0.1
        assert aborted.wait(30)
        assert stall.aborted
        with pytest.raises(CollectiveAborted, match="round broken .participant.s. lost: node-b"):
            settle(torch.device("cpu"), stall)
    finally:
        stall.close()


def test_steps_that_still_finish_after_a_round_broke_are_not_aborted() -> None:
    clock, aborted = FakeClock(), threading.Event()
    stall = StallAbort(5.0, aborted.set, clock=clock, poll_s=0.001)
    try:
        stall.round_broken("participant(s) restarted: node-b")
        for _ in range(3):  # a world that keeps stepping reaches its agreed stop
            clock.now += 4.0
            stall.progress()
            clock.wait_reads()
            assert not aborted.is_set()
        clock.now += 5.0
        assert aborted.wait(30)
    finally:
        stall.close()


def test_closing_the_stall_abort_releases_what_feeds_it() -> None:
    released: list[str] = []
    stall = StallAbort(5.0, lambda: None)
    stall.on_close(lambda: released.append("watch"))
    stall.on_close(lambda: released.append("client"))
    stall.close()
    stall.close()  # safe to call again
    assert released == ["client", "watch"]


@pytest.mark.parametrize("value", [None, "2", " 2 "])
def test_the_nccl_error_handling_the_abort_needs_is_set_quietly(value: str | None) -> None:
    environ = {} if value is None else {NCCL_ERROR_HANDLING_ENV: value}
    assert nccl_error_handling_override(environ) is None
    set_nccl_error_handling(environ)
    assert environ == {NCCL_ERROR_HANDLING_ENV: "2"}


@pytest.mark.parametrize("value", ["0", "1", "3"])
def test_another_nccl_error_handling_is_overridden_and_logged(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    environ = {NCCL_ERROR_HANDLING_ENV: value}
    with caplog.at_level(logging.WARNING, logger="kfp_elastic.worker"):
        set_nccl_error_handling(environ)
    assert environ == {NCCL_ERROR_HANDLING_ENV: "2"}
    assert f"TORCH_NCCL_ASYNC_ERROR_HANDLING='{value}' overridden with 2" in caplog.text


@pytest.mark.parametrize(
    ("value", "warned"), [(None, True), ("3", True), ("0", True), ("2", False)]
)
def test_a_script_whose_group_was_made_without_the_setting_is_warned(
    value: str | None, warned: bool
) -> None:
    environ = {} if value is None else {NCCL_ERROR_HANDLING_ENV: value}
    warning = nccl_error_handling_not_set(environ)
    assert (warning is not None) is warned
    if warning:
        assert "set it to 2 before dist.init_process_group" in warning
