"""Everything about a job that can be checked without training, checked once by the master
before any worker starts (``master/host.py``'s ``prestart_checks`` calls :func:`check`),
so that a mistake ends the master within seconds with a message that names the field or flag,
instead of after several failed worker starts.

- the runtime's command line (``-- -m kfp_elastic.worker ...``, or the one the master builds
  from ``--model-def``) through the runtime's own parser (``worker/options.py``), with the
  environment the workers get (the job's settings are in it: ``kfp_elastic/job_env.py``);
- the snapshot directory, the final model's directory and the local launcher's work
  directory: writable, or creatable (tried, then removed again);
- the model definition: loaded in a worker's environment as the runtime loads it (a module or a
  ``.py`` file, with the hooks it needs; ``worker/check_entry.py``) and its ``dataset("train")``
  has samples, as many as the shard manifest covers when the master publishes one;
- a command's script exists, its ``-m MODULE`` can be found.

Files, the model definition and a command's code are checked only where the master sees what
the workers see (``WorkerSide.files_here``): always for local workers; for worker pods when the
master runs in the same image with the same volumes (the KFP component), not from a laptop.
The decisions are pure functions; :func:`check` does the I/O.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kfp_elastic.job_env import SNAPSHOT_DIR_ENV, JobEnv
from kfp_elastic.job_spec import (
    MODULE_FLAGS,
    RUNTIME_MODULE,
    Entry,
    JobSpec,
    KubernetesSettings,
    Policy,
    field_error,
)
from kfp_elastic.master.ladder import LadderPolicy, check_priority_values
from kfp_elastic.worker.options import OptionsError, parse_args

_NO_PYTHON = ("--no-python", "--no_python")


class PreflightError(ValueError):
    """What is wrong with a job before it starts: one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n  ".join(["the job cannot start:", *problems]))
        self.problems = tuple(problems)


@dataclass(frozen=True)
class WorkerSide:
    """What a worker will see: its command (``JobSpec.worker_argv``), its environment (this
    process's with the job's variables over it), its working directory, and whether this process
    sees the same files and Python packages."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    files_here: bool = True
    workdir: Path | None = None  # the local launcher's (worker logs, exit records)


def runtime_args(argv: Sequence[str]) -> list[str] | None:
    """The runtime's own flags when ``argv`` runs the built-in runtime, else None."""
    if len(argv) >= 2 and argv[0] in MODULE_FLAGS and argv[1] == RUNTIME_MODULE:
        return list(argv[2:])
    return None


def flag_problems(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The runtime's flags, parsed by the runtime's parser with the workers' environment."""
    flags = runtime_args(argv)
    if flags is None:
        return []
    try:
        parse_args(flags, env)
    except OptionsError as error:
        return [f"worker flags ({shlex.join(flags)}): {error}"]
    return []


def locations(side: WorkerSide) -> dict[str, Path]:
    """The directories the job writes to, each under the name a user knows it by."""
    found: dict[str, Path] = {}
    flags = runtime_args(side.argv)
    if flags is not None:
        try:
            settings = parse_args(flags, side.env).settings
        except OptionsError:
            settings = None  # flag_problems reports it
        if settings is not None:
            found[str(field_error("snapshot_dir", ""))] = Path(settings.snapshot_dir)
            if settings.local_snapshot_dir:
                found["--local-snapshot-dir"] = Path(settings.local_snapshot_dir)
            if settings.output:
                found[f"--output {settings.output}: its directory"] = Path(settings.output).parent
    else:
        job = JobEnv.from_env(side.env)
        if job.snapshot_dir:
            found[f"snapshot_dir (${SNAPSHOT_DIR_ENV})"] = Path(job.snapshot_dir)
    if side.workdir is not None:
        found[str(field_error("workdir", ""))] = side.workdir
    return {name.strip(): path for name, path in found.items()}


def writable_problem(path: Path) -> str | None:
    """None when ``path`` is a directory this process can write to, or could create as one:
    tried by creating what is missing and a file in it, then removing all of that again."""
    path = Path(os.path.abspath(path))
    missing = []
    existing = path
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        return f"{path}: cannot be created, {existing} is not a directory"
    created: list[Path] = []
    try:
        for directory in reversed(missing):
            directory.mkdir()
            created.append(directory)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kfp-elastic-check-"):
            pass
    except OSError as error:
        verb = "written to" if not missing else "created"
        return f"{path}: cannot be {verb} ({error.strerror or error})"
    finally:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                directory.rmdir()
    return None


def samples_problem(spec: JobSpec, samples: int) -> str | None:
    """The dataset the workers train on against the manifest the master publishes."""
    manifest = spec.manifest()
    if manifest is None or manifest.num_samples == samples:
        return None
    given = "shard_manifest" if spec.data.shard_manifest else "dataset_length"
    return str(
        field_error(
            given,
            f"covers {manifest.num_samples} samples but dataset('train') of "
            f"{spec.entry.model_def or model_def_of(spec.worker_argv())} has {samples}: "
            "describe the dataset the model definition trains on",
        )
    )


def sharded_memory_problem(spec: JobSpec) -> str | None:
    """A sharded model's snapshots live in the pods' ``/dev/shm`` (docs/runtime.md, "Sharded
    models"): worker pods sized for none of it would fail at their first snapshot."""
    k8s = spec.launch.kubernetes
    if spec.launch.kind != "kubernetes" or k8s.sharded_state or k8s.shm_size:
        return None
    return (
        f"{spec.entry.model_def} shards its model (FSDP2): each worker process keeps 4 x state "
        "/ ranks of host memory in the pod's /dev/shm for its in-memory snapshots; give the "
        "state's size (parameters + optimizer state) as "
        + str(field_error("sharded_state", "", KubernetesSettings)).strip()
        + " so that each pod's /dev/shm and memory count it (or size /dev/shm yourself with "
        "shm_size)"
    )


def model_def_of(argv: Sequence[str]) -> str | None:
    """The ``--model-def`` the runtime gets, if ``argv`` runs it."""
    flags = runtime_args(argv)
    if not flags:
        return None
    for i, flag in enumerate(flags):
        if flag == "--model-def" and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith("--model-def="):
            return flag.split("=", 1)[1]
    return None


def run_entry_check(side: WorkerSide, kind: str, name: str, timeout_s: float) -> dict[str, object]:
    """``worker/check_entry.py`` in a worker's environment and working directory, for at most
    ``timeout_s`` (``--model-def-check-timeout``)."""
    from kfp_elastic.master.local_agent import with_package_on_path

    env = with_package_on_path({**os.environ, **side.env})
    with tempfile.TemporaryDirectory(prefix="kfp-elastic-check-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "kfp_elastic.worker.check_entry", str(result), kind, name]
        try:
            done = subprocess.run(
                command,
                cwd=side.cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {
                "error": f"{name}: loading it took over {timeout_s:g} s in the check before the "
                "workers start; a slow first load of its dataset needs more: raise "
                + str(field_error("model_def_check_timeout_s", "", Policy)).strip()
            }
        if not result.exists():
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            return {"error": f"{name}: the check broke (exit code {done.returncode}): {tail}"}
        return json.loads(result.read_text())


def entry_problems(spec: JobSpec, side: WorkerSide) -> list[str]:
    """The model definition (or the command's script or module) as a worker would load it."""
    argv = side.argv
    timeout_s = spec.policy.model_def_check_timeout_s
    model_def = model_def_of(argv)
    if model_def:
        found = run_entry_check(side, "model-def", model_def, timeout_s)
        if "error" in found:
            text = str(found["error"]).removeprefix("--model-def ")
            return [f"{str(field_error('model_def', '', Entry)).strip()} {text}"]
        samples = found.get("samples")
        problems = [samples_problem(spec, int(samples)) if isinstance(samples, int) else None]
        problems.append(sharded_memory_problem(spec) if found.get("sharded") else None)
        return [problem for problem in problems if problem]
    if runtime_args(argv) is not None or not argv or argv[0] in _NO_PYTHON:
        return []  # the runtime without --model-def: its parser said so
    if argv[0] in MODULE_FLAGS:
        found = run_entry_check(side, "module", argv[1], timeout_s)
        return [f"command (after --): {found['error']}"] if "error" in found else []
    script = Path(argv[0])
    if not (script if script.is_absolute() else side.cwd / script).is_file():
        return [f"command (after --): script {argv[0]} not found (from {side.cwd})"]
    return []


def check(spec: JobSpec, side: WorkerSide, defer_entry: bool = False) -> DeferredCheck | None:
    """Raise ``PreflightError`` listing the problems found; quiet when there is none. The
    model definition (seconds: it imports torch) is loaded only when the rest is right; with
    ``defer_entry`` it is loaded on a thread of its own and returned as a
    :class:`DeferredCheck` (the master creates worker pods meanwhile and fails the job, deleting
    them, if it fails)."""
    problems = flag_problems(side.argv, side.env)
    if side.files_here:
        for name, path in locations(side).items():
            problem = writable_problem(path)
            if problem:
                problems.append(f"{name} {problem}")
        if not problems:
            if defer_entry:
                return DeferredCheck(lambda: entry_problems(spec, side))
            problems = entry_problems(spec, side)
    if problems:
        raise PreflightError(problems)
    return None


class DeferredCheck:
    """A check that runs on a thread while the job starts (the model definition's load):
    :meth:`failure` is None while it runs and when it passed, else the message the job fails
    with; :attr:`seconds` is how long it ran (None while it runs).

    The thread only waits: the load itself is a subprocess (``run_entry_check``), so importing
    torch and the user's code takes neither this process's GIL nor its import lock from the
    master, which creates the worker pods meanwhile, and a model definition that crashes its
    interpreter or leaves threads behind does it in a process of its own."""

    def __init__(self, run: Callable[[], list[str]]) -> None:
        self._problems: list[str] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.seconds: float | None = None
        began = time.monotonic()

        def target() -> None:
            try:
                self._problems = run()
            except Exception as error:  # noqa: BLE001 - the check itself broke: say so
                self._problems = [f"the model definition's check broke: {error!r}"]
            finally:
                self.seconds = time.monotonic() - began
                with self._lock:
                    self._done.set()
                    callbacks = list(self._callbacks)
                for callback in callbacks:
                    callback()

        self._thread = threading.Thread(target=target, daemon=True, name="model-def-check")
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the check's thread) once the check has ended; at once if it
        has already (the master wakes its loop with it: a failure ends the job within
        seconds)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def failure(self) -> str | None:
        if not self._done.is_set() or not self._problems:
            return None
        return str(PreflightError(self._problems))


def ladder_classes_problem(
    k8s: KubernetesSettings, read_value: Callable[[str], int | None]
) -> str | None:
    """Whether the cluster's PriorityClasses let the job's ladder work
    (``ladder.check_priority_values``: every level's class exists, each above the next, all
    between the opportunistic class and serving). ``k8s``: the resolved settings;
    ``read_value(name)``: the class's value, None where the cluster has none. None: no ladder,
    or it can work."""
    policy = LadderPolicy.from_settings(k8s)
    if policy is None:
        return None
    names = (*policy.priority_classes, k8s.opportunistic_priority_class)
    values = {name: value for name in names if (value := read_value(name)) is not None}
    try:
        check_priority_values(policy, values, k8s.opportunistic_priority_class)
    except ValueError as error:
        return f"ladder_priority_classes (--ladder-priority-classes): {error}"
    return None
