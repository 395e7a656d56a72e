"""One namespace: the installed package puts only ``kfp_elastic`` in site-packages.

A Kubeflow user's pipeline repository very often has ``components/`` and ``pipelines/``
packages of its own; an installed ``kfp-elastic`` must neither shadow them nor be shadowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

GENERIC_NAMES = ("rendezvous", "master", "worker", "components", "pipelines")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy of the tracked files: setuptools writes build/ into the source tree.
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (t.decode() for t in tracked)):
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("kfp_elastic-*.whl")
    return built


def test_the_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top = {
            name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")
        }
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = archive.read(entry_points).decode()
    assert top == {"kfp_elastic"}
    assert "kfp-elastic = kfp_elastic.cli:main" in text
    assert "elastic-etcd = kfp_elastic.rendezvous.plugin:entry_point" in text
    # The compiled component and pipeline YAML ship with the package.
    assert "kfp_elastic/components/elastic_train/component.yaml" in names
    assert "kfp_elastic/pipelines/elastic_training.yaml" in names


@pytest.mark.timeout(300)
def test_a_fresh_venv_imports_kfp_elastic_and_no_generic_names(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    # The venv has no pip of its own: the outer pip installs the wheel into its site-packages.
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        "import importlib, json\n"
        "import kfp_elastic, kfp_elastic.cli\n"
        "missing = []\n"
        f"for name in {GENERIC_NAMES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        missing.append(name)\n"
        "print(json.dumps({'file': kfp_elastic.__file__, 'missing': missing}))\n"
    )
    result = subprocess.run(
        [python, "-I", "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f'"missing": {list(GENERIC_NAMES)!r}'.replace("'", '"') in result.stdout
    assert site in result.stdout


def _user_project(root: Path) -> Path:
    """A user's pipeline repository whose generic packages blow up when imported."""
    for name in GENERIC_NAMES:
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ImportError('the user project\\'s own {name!r} package was imported')\n"
        )
    return root


@pytest.mark.timeout(300)
def test_run_local_is_unharmed_by_a_user_projects_own_packages(tmp_path: Path) -> None:
    project = _user_project(tmp_path / "user-project")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfp_elastic",
            "run-local",
            "--pipeline-root",
            str(tmp_path / "runs"),
            "--epochs",
            "1",
            "--num-shards",
            "4",
            "--max-workers",
            "1",
            "--step-time",
            "0",
            "--inject-faults",
            "",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "the user project" not in output
