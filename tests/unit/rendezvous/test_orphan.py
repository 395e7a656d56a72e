"""No orphans (rendezvous/orphan.py): the decision to stop without a master, the watch that
applies it, the setting from the job to the agents, and how a later master counts such a
worker (a disruption, not a failure)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from kfp_elastic.contract.rendezvous_config import ConfigError, RendezvousConfig
from kfp_elastic.contract.worker_end import (
    END_ORPHANED,
    END_SIGTERM,
    WorkerEnd,
    read_end,
    record_end,
)
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_env import WORKER_NAME_VARS
from kfp_elastic.job_spec import (
    DEFAULT_ORPHAN_TIMEOUT_S,
    ORPHAN_CONF_KEY,
    Entry,
    JobSpec,
    Launch,
    Policy,
)
from kfp_elastic.master.launcher import Reason, WorkerPhase
from kfp_elastic.master.pod_status import classify
from kfp_elastic.master.scaling import outcome_of
from kfp_elastic.rendezvous import agent, orphan
from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler
from kfp_elastic.rendezvous.orphan import (
    MAX_POLL_S,
    MIN_POLL_S,
    ORPHANED_EXIT_CODE,
    MasterWatch,
    master_gone_since,
    orphaned,
    poll_interval,
)

# -- the decision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "present, gone_since, now, expected",
    [
        (True, None, 10.0, None),  # a master: nothing to count
        (True, 4.0, 10.0, None),  # a master came back: the clock resets
        (False, None, 10.0, 10.0),  # first seen gone: counting starts now
        (False, 4.0, 10.0, 4.0),  # still gone: since the first time
        (None, None, 10.0, None),  # etcd did not answer: no evidence, no clock
        (None, 4.0, 10.0, 4.0),  # ... and no reset either
    ],
)
def test_master_gone_since(
    present: bool | None, gone_since: float | None, now: float, expected: float | None
) -> None:
    assert master_gone_since(present, gone_since, now) == expected


@pytest.mark.parametrize(
    "gone_since, now, timeout, stop",
    [
        (None, 1000.0, 300.0, False),  # a master is there
        (100.0, 399.9, 300.0, False),  # gone, not long enough
        (100.0, 400.0, 300.0, True),  # gone for the timeout
        (100.0, 1000.0, 300.0, True),
        (0.0, 3.0, 3.0, True),  # a short timeout (tests)
    ],
)
def test_orphaned(gone_since: float | None, now: float, timeout: float, stop: bool) -> None:
    assert orphaned(gone_since, now, timeout) is stop


def test_poll_interval_is_a_tenth_of_the_timeout_within_bounds() -> None:
    assert poll_interval(DEFAULT_ORPHAN_TIMEOUT_S) == MAX_POLL_S == 10.0
    assert poll_interval(30.0) == 3.0
    assert poll_interval(1.0) == MIN_POLL_S


# -- the watch ---------------------------------------------------------------------------------


class FakeEtcd:
    """``get`` answers from ``values`` (None: no key), or raises when ``down``."""

    def __init__(self) -> None:
        self.value: bytes | None = b'{"id": "master-1"}'
        self.down = False

    def get(self, key: str) -> tuple[bytes | None, Any]:
        if self.down:
            raise ConnectionError("etcd unavailable")
        return self.value, None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(timeout: float = 3.0) -> tuple[MasterWatch, FakeEtcd, Clock, list[float]]:
    etcd, clock, fired = FakeEtcd(), Clock(), []
    w = MasterWatch(etcd, "/p/r/master/leader", timeout, fired.append, clock=clock)  # type: ignore[arg-type]
    return w, etcd, clock, fired


def test_stops_once_the_master_has_been_gone_for_the_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rendezvous/plugin.py gives the package's loggers a handler of their own under torchrun.
    monkeypatch.setattr(logging.getLogger("kfp_elastic.rendezvous"), "propagate", True)
    w, etcd, clock, fired = watch(timeout=3.0)
    assert not w.check()  # a master holds the leadership
    etcd.value = None  # its lease expired (or it stepped down)
    clock.now = 10.0
    assert not w.check() and w.gone_since == 10.0
    clock.now = 12.9
    assert not w.check()
    etcd.down = True  # etcd away: no stop without an answer; the clock goes on
    clock.now = 13.5
    assert not w.check() and w.gone_since == 10.0 and fired == []
    etcd.down = False
    with caplog.at_level("ERROR", logger=orphan.__name__):
        assert w.check()
    assert fired == [3.5]
    assert "no master for 4 s: stopping" in caplog.text
    clock.now = 20.0
    assert not w.check() and fired == [3.5]  # once only


def test_a_master_back_within_the_timeout_keeps_the_workers() -> None:
    w, etcd, clock, fired = watch(timeout=3.0)
    etcd.value = None
    assert not w.check()
    clock.now = 2.5
    etcd.value = b'{"id": "master-2"}'  # a KFP retry took the leadership over
    assert not w.check() and w.gone_since is None
    etcd.value = None  # gone again later: counted afresh
    clock.now = 4.0
    assert not w.check() and w.gone_since == 4.0
    clock.now = 6.9
    assert not w.check() and fired == []


def test_the_watch_thread_fires_and_ends() -> None:
    etcd, fired = FakeEtcd(), []
    etcd.value = None
    w = MasterWatch(etcd, "k", 0.3, fired.append).start()  # type: ignore[arg-type]
    w._thread.join(timeout=5)
    assert not w._thread.is_alive() and len(fired) == 1 and fired[0] >= 0.3


# -- the agent's exit code ---------------------------------------------------------------------


def test_the_agent_exits_orphaned_exit_code_after_stopping_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed.run

    def stopped(argv: list[str]) -> None:  # torchrun after the SIGTERM the watch sent
        raise SignalException("Process got signal: 15", sigval=15)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    with pytest.raises(SignalException):  # a SIGTERM from outside: torchrun's own ending
        agent.main([])
    monkeypatch.setattr(orphan, "_stopped_after", 3.2)
    assert agent.main([]) == ORPHANED_EXIT_CODE == 75


# -- the setting, from the job to every agent ------------------------------------------------


def test_the_job_hands_its_orphan_timeout_to_every_agent() -> None:
    spec = JobSpec(run_id="r", entry=Entry(model_def="m"), policy=Policy(orphan_timeout_s=2.5))
    conf = spec.worker_rdzv_conf()
    assert conf[ORPHAN_CONF_KEY] == "2.5"
    config = RendezvousConfig.from_params("127.0.0.1:2379", "r", 1, 2, None, conf, env={})
    assert config.orphan_timeout == 2.5
    default = JobSpec(run_id="r", entry=Entry(model_def="m")).worker_rdzv_conf()
    assert default[ORPHAN_CONF_KEY] == "300" and DEFAULT_ORPHAN_TIMEOUT_S == 300.0


def test_a_plain_torchrun_agent_has_no_master_to_watch() -> None:
    assert RendezvousConfig.from_params("h:1", "r", 1, 1, None, {}, env={}).orphan_timeout is None


@pytest.mark.parametrize(
    "spec, error",
    [
        (
            JobSpec(run_id="r", entry=Entry(model_def="m"), policy=Policy(orphan_timeout_s=0)),
            "orphan_timeout_s (--orphan-timeout / orphan_timeout_s) must be > 0",
        ),
        (
            JobSpec(
                run_id="r",
                entry=Entry(model_def="m"),
                launch=Launch(rdzv_conf={"orphan_timeout": "5"}),
            ),
            "orphan_timeout: give it as orphan_timeout_s (--orphan-timeout / orphan_timeout_s)",
        ),
    ],
)
def test_bad_orphan_timeouts_are_refused(spec: JobSpec, error: str) -> None:
    with pytest.raises(ValueError) as raised:
        spec.validate()
    assert error in str(raised.value)


def test_agents_refuse_a_non_positive_orphan_timeout() -> None:
    with pytest.raises(ConfigError, match="orphan_timeout=-1.0 must be > 0"):
        RendezvousConfig.from_params("h:1", "r", 1, 1, None, {"orphan_timeout": "-1"}, env={})


# -- a later master: a disruption, not a failure -----------------------------------------------


def failed_pod(exit_code: int) -> dict[str, Any]:
    terminated = {"name": "worker", "state": {"terminated": {"exitCode": exit_code}}}
    return {
        "metadata": {"name": "job-worker-0-0", "labels": {}},
        "status": {"phase": "Failed", "containerStatuses": [terminated]},
    }


def test_a_pod_that_stopped_itself_is_a_disruption() -> None:
    status = classify(failed_pod(ORPHANED_EXIT_CODE))
    assert (status.phase, status.reason) == (WorkerPhase.FAILED, Reason.ORPHANED)
    assert status.is_disruption and not status.is_failure
    outcome = outcome_of(status)
    assert outcome.cause == "orphaned" and not outcome.failure
    assert classify(failed_pod(1)).reason is Reason.ERROR


def test_the_orphan_stop_is_recorded_and_the_workers_sigterm_does_not_replace_it(
    etcd: EmbeddedEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = connect(etcd.client_settings())
    try:
        prefix = f"/kfp-elastic-test/{run_id}"
        handler = object.__new__(ElasticEtcdRendezvousHandler)  # only what the stop uses
        handler._client = client
        handler._config = SimpleNamespace(run_prefix=prefix)
        stopped: list[float] = []
        monkeypatch.setattr(orphan, "stop_agent", stopped.append)
        monkeypatch.setenv(WORKER_NAME_VARS[0], "worker-1-0")
        handler._stop_orphaned(300.0)
        assert stopped == [300.0]
        # The SIGTERM the agent sent itself reaches the worker, which records its end too.
        record_end(client, prefix, "worker-1-0", WorkerEnd(END_SIGTERM, 1.0, 7, 2))
        end = read_end(client, prefix, "worker-1-0")
        assert end is not None and (end.end, end.message) == (END_ORPHANED, "no master for 300 s")
        # Any other worker's SIGTERM is recorded as it is.
        record_end(client, prefix, "worker-2-0", WorkerEnd(END_SIGTERM, 1.0, 7, 2))
        other = read_end(client, prefix, "worker-2-0")
        assert other is not None and other.end == END_SIGTERM
    finally:
        client.close()
