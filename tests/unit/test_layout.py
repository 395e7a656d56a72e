"""The layers' rule, read from docs/architecture.md's table "What each part may import".

Every import of every Python file in ``kfp_elastic/``, ``benchmarks/``, ``examples/`` and
``tests/`` goes to the file's own part or to a part its row names, and every library it imports is
one its row lists (the standard library is always allowed). Imports count wherever they stand:
at module level, inside a function, under ``TYPE_CHECKING``; so do the modules a file loads by
name (a file that calls ``importlib.import_module`` or ``__import__`` imports every module its
strings name, the console script's ``SUBCOMMANDS`` table included). A file belongs to the part
that names it, else to the one whose folder holds it, so a new file needs no new row.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import pytest

from kfp_elastic import cli
from tests.helpers import REPO_ROOT

DOC = REPO_ROOT / "docs" / "architecture.md"
SECTION = "## What each part may import"
FOLDERS = ("kfp_elastic", "benchmarks", "examples", "tests")
FIRST_PARTY = ("kfp_elastic", "benchmarks", "examples", "tests")
EVERY_PART_ABOVE = "every part above"
NONE = "—"
ANY = "any"
ROOT_MODULES = "kfp_elastic/*.py"  # the package root's modules no row names itself
LOADERS = {"import_module", "__import__"}
MODULE_NAME = re.compile(rf"(?:{'|'.join(FIRST_PARTY)})(?:\.\w+)*")


@dataclass(frozen=True)
class Part:
    name: str
    holds: tuple[str, ...]  # "kfp_elastic/etcd/" (a folder), "kfp_elastic/cli.py", ROOT_MODULES
    may_import: frozenset[str]  # other parts
    libraries: frozenset[str] | None  # None: any


def read_table(text: str) -> list[Part]:
    """The parts in the table's order (the ground floor first)."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    parts: list[Part] = []
    for row in rows:
        name, holds, may_import, libraries = (cell.strip() for cell in row.strip("|").split("|"))
        if may_import == EVERY_PART_ABOVE:
            allowed = frozenset(p.name for p in parts)
        elif may_import == NONE:
            allowed = frozenset()
        else:
            allowed = frozenset(n.strip() for n in may_import.split(","))
        parts.append(
            Part(
                name,
                tuple(re.findall(r"`([^`]+)`", holds)),
                allowed,
                None if libraries == ANY else frozenset(re.findall(r"`([^`]+)`", libraries)),
            )
        )
    return parts


@cache
def table() -> tuple[Part, ...]:
    return tuple(read_table(DOC.read_text()))


def part_of(path: str, parts: tuple[Part, ...] | None = None) -> Part | None:
    """The part of repository path ``path``: the row that names the file, else the row of the
    innermost folder that holds it, else (a module at the package root) the ``ROOT_MODULES`` row."""
    parts = table() if parts is None else parts
    named = [p for p in parts if path in p.holds]
    if named:
        return named[0]
    folders = [
        (len(held), p)
        for p in parts
        for held in p.holds
        if held.endswith("/") and path.startswith(held)
    ]
    if folders:
        return max(folders, key=lambda found: found[0])[1]
    if re.fullmatch(r"kfp_elastic/[^/]+\.py", path):
        return next((p for p in parts if ROOT_MODULES in p.holds), None)
    return None


def file_of(module: str) -> str | None:
    """The repository path of first-party ``module`` (None: no such module, e.g. a name that
    ``from PACKAGE import name`` takes from a package)."""
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (REPO_ROOT / candidate).is_file():
            return candidate
    return None


def module_of(name: str) -> str:
    """The innermost module of dotted ``name`` that is a file (``kfp_elastic.master.job.Job`` →
    ``kfp_elastic/master/job.py``)."""
    parts = name.split(".")
    while parts:
        found = file_of(".".join(parts))
        if found:
            return found
        parts.pop()
    return name.replace(".", "/") + ".py"  # not in the tree: judged by where it would be


def imports_of(source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``source``: module level or not, and every
    first-party module named by a string in a source that loads modules by name."""
    tree = ast.parse(source)
    loads_by_name = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield node.lineno, "." * node.level + (node.module or "")
                continue
            module = node.module or ""
            for alias in node.names:
                loads_by_name = loads_by_name or alias.name in LOADERS
                whole = f"{module}.{alias.name}"
                is_module = module.startswith(FIRST_PARTY) and file_of(whole)
                yield node.lineno, whole if is_module else module
        elif isinstance(node, ast.Name) and node.id in LOADERS:
            loads_by_name = True
        elif isinstance(node, ast.Attribute) and node.attr in LOADERS:
            loads_by_name = True
    if loads_by_name:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and MODULE_NAME.fullmatch(node.value)
                and file_of(node.value)
            ):
                yield node.lineno, node.value


def offences(path: str, source: str, parts: tuple[Part, ...] | None = None) -> list[str]:
    """What in ``source`` (the text of repository file ``path``) the table does not allow."""
    parts = table() if parts is None else parts
    own = part_of(path, parts)
    if own is None:
        return [f"{path}: in no part of the table"]
    found = []
    for line, name in imports_of(source):
        where = f"{path}:{line} ({own.name}) imports {name}"
        top = name.split(".")[0]
        if name.startswith("."):
            found.append(f"{where}: a relative import")
        elif top in FIRST_PARTY:
            target = part_of(module_of(name), parts)
            if target is None:
                found.append(f"{where}: in no part of the table")
            elif target.name != own.name and target.name not in own.may_import:
                found.append(f"{where}: {target.name} is not a part it may import")
        elif top not in sys.stdlib_module_names and own.libraries is not None:
            if top not in own.libraries:
                found.append(f"{where}: {top} is not a library it may import")
    return found


def python_files() -> list[str]:
    return sorted(
        str(p.relative_to(REPO_ROOT))
        for folder in FOLDERS
        for p in (REPO_ROOT / folder).rglob("*.py")
    )


# -- the rule, held against the code --------------------------------------------------------


def test_every_file_is_in_a_part() -> None:
    files = python_files()
    assert len(files) > 200
    assert [path for path in files if part_of(path) is None] == []


def test_every_import_is_one_the_table_allows() -> None:
    found = [
        offence
        for path in python_files()
        for offence in offences(path, (REPO_ROOT / path).read_text())
    ]
    assert found == [], "\n".join(found)


def test_the_console_scripts_subcommands_count_as_its_imports() -> None:
    source = (REPO_ROOT / "kfp_elastic" / "cli.py").read_text()
    imported = {name for _, name in imports_of(source)}
    assert {sub.module for sub in cli.SUBCOMMANDS.values()} <= imported


# -- the table itself -----------------------------------------------------------------------


def test_layers_point_down() -> None:
    """A part imports only parts above it in the table: no import runs back up, no circle."""
    above: set[str] = set()
    for part in table():
        assert part.may_import <= above, f"{part.name} may import {part.may_import - above}"
        above.add(part.name)


def test_product_code_never_imports_the_testing_package_benchmarks_or_tests() -> None:
    not_product = {"testing", "benchmarks", "examples", "tests"}
    names = [p.name for p in table()]
    assert not_product <= set(names)
    for part in table():
        if part.name not in not_product:
            assert not part.may_import & not_product, part.name
    assert all(not {"tests"} & p.may_import for p in table() if p.name != "tests")


def test_parts_follow_the_folders() -> None:
    assert part_of("kfp_elastic/etcd/a_new_module.py").name == "etcd layer"
    assert part_of("kfp_elastic/testing/cluster/a_new_module.py").name == "testing"
    assert part_of("kfp_elastic/job_spec.py").name == "contract"
    assert part_of("kfp_elastic/a_new_module.py").name == "ground"
    assert part_of("tests/unit/test_layout.py").name == "tests"


# -- the rule catches what it must ----------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "from kfp_elastic.master.job import Job\n",
        "def stop():\n    from kfp_elastic.master import job\n",
        "import importlib\n\nJOB = importlib.import_module('kfp_elastic.master.job')\n",
        "def load():\n    return __import__('kfp_elastic.master.job')\n",
        "from importlib import import_module\n\nTABLE = {'job': 'kfp_elastic.master.job'}\n",
        "import typing\n\nif typing.TYPE_CHECKING:\n    from kfp_elastic import worker\n",
        "import kubernetes\n",
        "def f():\n    from tests.helpers import REPO_ROOT\n",
    ],
    ids=[
        "module-level",
        "function-level",
        "import_module",
        "__import__",
        "a table of module names",
        "type-checking",
        "a library",
        "the tests",
    ],
)
def test_the_rule_refuses_an_import_the_table_does_not_allow(source: str) -> None:
    assert offences("kfp_elastic/etcd/a_new_module.py", source) != []


@pytest.mark.parametrize(
    "source",
    [
        "from kfp_elastic.etcd.keys import RunKeys\nimport pyetcd\n",
        "def f():\n    from kfp_elastic import job_spec\n",
        "import importlib\n\nCLI = importlib.import_module('kfp_elastic.master.cli')\n",
        "import json\nimport kubernetes\n",
    ],
)
def test_the_rule_allows_what_the_table_allows(source: str) -> None:
    assert offences("kfp_elastic/master/a_new_module.py", source) == []
