"""The master's check of a job before any worker starts (``master/preflight.py``): each mistake
ends the master with a message that names the field or flag, and no worker is launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.etcd.settings import EtcdSettings, parse_endpoints
from kfp_elastic.job_spec import (
    Data,
    Entry,
    JobSpec,
    KubernetesSettings,
    Launch,
    LocalSettings,
    Policy,
    Training,
)
from kfp_elastic.master.host import make_launcher, plan, prestart_checks
from kfp_elastic.master.preflight import (
    DeferredCheck,
    PreflightError,
    WorkerSide,
    check,
    flag_problems,
    locations,
    model_def_of,
    samples_problem,
    sharded_memory_problem,
    writable_problem,
)
from tests.helpers import REPO_ROOT, master_command

DIGITS = "kfp_elastic.worker.examples.digits"
DIGITS_TRAIN = 1437  # samples of dataset("train")
ETCD_ENV = {"KFP_ELASTIC_ETCD_ENDPOINTS": "127.0.0.1:1"}
GOOD_MODEL = f"from {DIGITS} import dataset, loss, model  # noqa: F401\n"


def runtime(*flags: str) -> tuple[str, ...]:
    return ("-m", "kfp_elastic.worker", *flags)


def side(tmp_path: Path, argv: tuple[str, ...], **env: str) -> WorkerSide:
    return WorkerSide(argv, {**ETCD_ENV, **env}, tmp_path, workdir=tmp_path / "work")


# -- pure decisions -----------------------------------------------------------------------------


def test_the_runtimes_own_parser_judges_the_worker_flags() -> None:
    env = {**ETCD_ENV, "KFP_ELASTIC_SNAPSHOT_DIR": "/tmp/s"}
    assert flag_problems(runtime("--model-def", DIGITS, "--epochs", "2"), env) == []
    (typo,) = flag_problems(runtime("--model-def", DIGITS, "--epochz", "2"), env)
    assert typo == "worker flags (--model-def " + DIGITS + " --epochz 2): unrecognized " + (
        "arguments: --epochz 2"
    )
    (bad,) = flag_problems(runtime("--model-def", DIGITS, "--policy", "cubic"), env)
    assert "--policy" in bad and "cubic" in bad
    (missing,) = flag_problems(runtime("--epochs", "2"), env)
    assert "the following arguments are required: --model-def" in missing
    (no_dir,) = flag_problems(runtime("--model-def", DIGITS), ETCD_ENV)
    assert "--snapshot-dir (or KFP_ELASTIC_SNAPSHOT_DIR) is required" in no_dir
    assert flag_problems(("train.py", "--epochz", "2"), env) == []  # a user's own script


def test_locations_are_named_as_the_user_gave_them(tmp_path: Path) -> None:
    argv = runtime("--model-def", DIGITS, "--snapshot-dir", "/s", "--output", "/o/m.pt")
    found = locations(side(tmp_path, argv))
    assert found == {
        "snapshot_dir (--snapshot-dir / snapshot_dir)": Path("/s"),
        "--output /o/m.pt: its directory": Path("/o"),
        "workdir (--workdir / workdir)": tmp_path / "work",
    }
    own = locations(side(tmp_path, ("train.py",), KFP_ELASTIC_SNAPSHOT_DIR="/s"))
    assert own["snapshot_dir ($KFP_ELASTIC_SNAPSHOT_DIR)"] == Path("/s")


def test_an_unwritable_location_is_refused(tmp_path: Path) -> None:
    assert writable_problem(tmp_path / "new" / "dir") is None
    assert not (tmp_path / "new").exists()  # tried, and removed again
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = writable_problem(blocker / "snapshots")
    assert problem == f"{blocker}/snapshots: cannot be created, {blocker} is not a directory"
    read_only = writable_problem(Path("/proc/kfp-elastic/snapshots"))
    assert read_only is not None and "/proc/kfp-elastic/snapshots: cannot be created" in read_only


def test_the_dataset_must_match_the_manifest_the_master_publishes() -> None:
    spec = JobSpec(
        run_id="r", entry=Entry(model_def=DIGITS), data=Data(dataset_length=100, shard_size=10)
    )
    assert samples_problem(spec, 100) is None
    problem = samples_problem(spec, DIGITS_TRAIN)
    assert problem is not None and problem.startswith("dataset_length (--dataset-length)")
    assert f"covers 100 samples but dataset('train') of {DIGITS} has {DIGITS_TRAIN}" in problem
    assert samples_problem(JobSpec(run_id="r", entry=Entry(model_def=DIGITS)), 5) is None


def test_the_model_def_flag_is_found_in_either_spelling() -> None:
    assert model_def_of(runtime("--model-def", "a.b")) == "a.b"
    assert model_def_of(runtime("--model-def=x.py")) == "x.py"
    assert model_def_of(("-m", "other", "--model-def", "a")) is None


# -- the checks, with a worker's view of the files ----------------------------------------------


def _check(tmp_path: Path, *flags: str) -> str:
    spec = JobSpec(run_id="r", entry=Entry(command=runtime(*flags)))
    with pytest.raises(PreflightError) as raised:
        check(spec, side(tmp_path, spec.worker_argv(), KFP_ELASTIC_SNAPSHOT_DIR=str(tmp_path)))
    return str(raised.value)


def test_a_model_def_file_with_a_syntax_error_is_named(tmp_path: Path) -> None:
    (tmp_path / "my_model.py").write_text("def model(:\n")
    message = _check(tmp_path, "--model-def", "my_model.py")
    assert message.startswith("the job cannot start:")
    assert "model_def (--model-def / model_def) my_model.py: SyntaxError" in message
    assert "line 1" in message


def test_a_model_def_raising_while_imported_is_named_with_where(tmp_path: Path) -> None:
    spec = JobSpec(
        run_id="r", entry=Entry(command=runtime("--model-def", "tests.model_defs.raises_at_import"))
    )
    with pytest.raises(PreflightError) as raised:
        env = {"KFP_ELASTIC_SNAPSHOT_DIR": str(tmp_path)}
        check(spec, WorkerSide(spec.worker_argv(), {**ETCD_ENV, **env}, REPO_ROOT))
    message = str(raised.value)
    assert "RuntimeError: raises_at_import: this model definition is broken on purpose" in message
    assert "tests/model_defs/raises_at_import.py:3)" in message


def test_a_model_def_check_that_outlasts_its_timeout_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "slow_model.py").write_text("import time\ntime.sleep(60)\n")
    spec = JobSpec(
        run_id="r",
        entry=Entry(command=runtime("--model-def", "slow_model.py")),
        policy=Policy(model_def_check_timeout_s=0.5),
    )
    with pytest.raises(PreflightError) as raised:
        check(spec, side(tmp_path, spec.worker_argv(), KFP_ELASTIC_SNAPSHOT_DIR=str(tmp_path)))
    message = str(raised.value)
    assert "slow_model.py: loading it took over 0.5 s in the check" in message
    assert "model_def_check_timeout_s (--model-def-check-timeout / model_def_check_timeout_s)" in (
        message
    )


def test_a_model_def_without_its_hooks_or_not_found_is_named(tmp_path: Path) -> None:
    (tmp_path / "half.py").write_text("def model():\n    return None\n")
    assert "half lacks loss(), dataset()" in _check(tmp_path, "--model-def", "half")
    missing = _check(tmp_path, "--model-def", "no_such_model")
    assert "no_such_model: module not found" in missing
    assert "no such file" in _check(tmp_path, "--model-def", "nowhere/model.py")


def test_a_model_def_in_the_callers_directory_passes_by_path_or_name(tmp_path: Path) -> None:
    (tmp_path / "my_model.py").write_text(GOOD_MODEL)
    for name in ("my_model.py", str(tmp_path / "my_model.py"), "my_model"):
        spec = JobSpec(run_id="r", entry=Entry(command=runtime("--model-def", name)))
        check(spec, side(tmp_path, spec.worker_argv(), KFP_ELASTIC_SNAPSHOT_DIR=str(tmp_path)))


def test_a_missing_script_or_module_of_a_command_is_named(tmp_path: Path) -> None:
    for argv, message in (
        (("train.py", "--lr", "1"), "command (after --): script train.py not found"),
        (("-m", "no_such_pkg.train"), "command (after --): -m no_such_pkg.train: No module named"),
    ):
        spec = JobSpec(run_id="r", entry=Entry(command=argv))
        with pytest.raises(PreflightError) as raised:
            check(spec, side(tmp_path, argv))
        assert message in str(raised.value)


def test_the_host_checks_and_a_model_def_file_reaches_workers_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(GOOD_MODEL)
    etcd = EtcdSettings(endpoints=parse_endpoints("127.0.0.1:1"))
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="my_model.py"),
        training=Training(snapshot_dir=str(tmp_path / "snap")),
        etcd=etcd,
        launch=Launch(local=LocalSettings(workdir=str(tmp_path / "work"))),
    )
    launch = plan(spec)
    prestart_checks(launch)
    launcher = make_launcher(launch, None)
    assert launcher.entry[launcher.entry.index("--model-def") + 1] == str(tmp_path / "my_model.py")
    assert launcher.cwd == tmp_path
    bad = replace(spec, entry=Entry(model_def="my_modle.py"))
    with pytest.raises(PreflightError, match="my_modle.py: no such file"):
        prestart_checks(plan(bad))


def test_a_master_adopting_a_running_job_does_not_load_the_model_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted or retried master (the run has workers) skips the model definition's and
    the dataset's load, which take seconds or more at every start; flags are still checked."""
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="my_modle.py"),  # would be refused on a first start
        training=Training(snapshot_dir=str(tmp_path / "snap")),
        etcd=EtcdSettings(endpoints=parse_endpoints("127.0.0.1:1")),
        launch=Launch(local=LocalSettings(workdir=str(tmp_path / "work"))),
    )
    prestart_checks(plan(spec), adopting=True)
    with pytest.raises(PreflightError, match="my_modle.py: no such file"):
        prestart_checks(plan(spec))


# -- the master: refused before any worker starts -------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "flags", "message"),
    [
        (
            ["--model-def", DIGITS, "--epochz", "2"],
            {},
            "worker flags (--model-def " + DIGITS + " --epochz 2): unrecognized arguments",
        ),
        (
            ["--model-def", "my_model.py"],
            {},
            "model_def (--model-def / model_def) my_model.py: SyntaxError",
        ),
        (
            [],
            {"model_def": DIGITS, "snapshot_dir": "BLOCKED/snapshots"},
            "snapshot_dir (--snapshot-dir / snapshot_dir) ",
        ),
    ],
    ids=["worker-flag-typo", "model-def-syntax-error", "unwritable-snapshot-dir"],
)
def test_the_master_refuses_a_bad_job_before_any_worker_starts(
    tmp_path: Path, etcd: Any, run_id: str, entry: list[str], flags: dict[str, str], message: str
) -> None:
    (tmp_path / "my_model.py").write_text("def model(:\n")
    (tmp_path / "BLOCKED").write_text("a file, not a directory")
    work = tmp_path / "work"
    command = master_command(entry, run_id=run_id, etcd=etcd.endpoint, workdir=str(work), **flags)
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 2, result.stderr
    assert "kfp-elastic master: error: the job cannot start:" in result.stderr
    assert message in result.stderr
    assert not (work / "workers").exists() or not list((work / "workers").iterdir())


def test_a_sharded_model_on_pods_needs_its_host_memory_counted() -> None:
    def spec(kind: str, **k8s: str) -> JobSpec:
        settings = KubernetesSettings(**k8s)
        return JobSpec(
            run_id="r",
            entry=Entry(model_def="pkg.big"),
            launch=Launch(kind=kind, kubernetes=settings),
        )

    problem = sharded_memory_problem(spec("kubernetes"))
    assert problem is not None and problem.startswith("pkg.big shards its model (FSDP2)")
    assert "sharded_state (--sharded-state / worker_sharded_state)" in problem
    assert sharded_memory_problem(spec("kubernetes", sharded_state="12Gi")) is None
    assert sharded_memory_problem(spec("kubernetes", shm_size="40Gi")) is None
    assert sharded_memory_problem(spec("local")) is None  # this machine's /dev/shm


def test_a_sharded_model_def_is_reported_by_the_check(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    subprocess.run(
        [
            *(sys.executable, "-m", "kfp_elastic.worker.check_entry", str(result)),
            *("model-def", "kfp_elastic.worker.examples.digits_sharded"),
        ],
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert json.loads(result.read_text()) == {"samples": DIGITS_TRAIN, "sharded": True}


def test_the_check_entry_result_is_json(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    subprocess.run(
        [sys.executable, "-m", "kfp_elastic.worker.check_entry", str(result), "model-def", DIGITS],
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert json.loads(result.read_text()) == {"samples": DIGITS_TRAIN, "sharded": False}


def test_a_deferred_check_reports_its_failure_and_calls_back_once_it_ends() -> None:
    release = threading.Event()
    called: list[str] = []
    check = DeferredCheck(lambda: ["model_def (--model-def) m.py: broken"] * release.wait(30))
    check.when_done(lambda: called.append("first"))
    assert not check.done and check.failure() is None and check.seconds is None
    release.set()
    assert check.wait(30)
    check._thread.join(30)  # the callbacks run on the check's thread, after done
    assert called == ["first"]
    assert "the job cannot start:" in (check.failure() or "") and "broken" in check.failure()
    assert check.seconds is not None and check.seconds >= 0
    check.when_done(lambda: called.append("late"))  # already ended: called at once
    assert called == ["first", "late"]


def test_a_deferred_check_that_raises_fails_the_job_with_what_it_raised() -> None:
    def broken() -> list[str]:
        raise OSError("no such interpreter")

    check = DeferredCheck(broken)
    assert check.wait(30)
    assert "the model definition's check broke" in (check.failure() or "")
    assert "no such interpreter" in (check.failure() or "")
