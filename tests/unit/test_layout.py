"""The package layout's rules: product code never imports the testing package or the tests, and
the testing package and the benchmarks never import the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "kfp_elastic"


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO_ROOT / folder).rglob("*.py"))


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(REPO_ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def product_files() -> list[Path]:
    return [p for p in python_files("kfp_elastic") if (PACKAGE / "testing") not in p.parents]


def test_product_code_never_imports_the_testing_package_or_the_tests() -> None:
    files = product_files()
    assert len(files) > 50
    assert offenders(files, ("kfp_elastic.testing", "tests")) == []


@pytest.mark.parametrize("folder", ["kfp_elastic/testing", "benchmarks"])
def test_testing_and_benchmarks_never_import_the_tests(folder: str) -> None:
    files = python_files(folder)
    assert files
    assert offenders(files, ("tests",)) == []


def test_the_rule_finds_an_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kfp_elastic.testing.cluster import TestCluster\n")
    assert imported_modules(module) == {"kfp_elastic.testing.cluster"}
