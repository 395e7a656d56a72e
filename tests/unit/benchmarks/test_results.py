"""The committed results: every file under ``benchmarks/results`` is named as the harness names
a result (``<suite>/<name>-<YYYY-MM-DD>-<commit>[-<what>].<ext>``, ``<name>`` the suite or, in
``scheduling/``, one of its subcommands), a page of the documentation cites it, and every
result a page cites exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import SUITES
from benchmarks.harness import RESULTS
from benchmarks.scheduling.suite import COMMANDS
from tests.helpers import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
NAME = re.compile(
    r"^(?P<name>[a-z0-9_]+(?:-[a-z0-9]+)*?)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<commit>[0-9a-f]{7,12})"
    r"(?:-[a-z0-9]+(?:-[a-z0-9]+)*)?\.(?:json|png|txt)$"
)
CITED = re.compile(r"benchmarks/results/[\w./-]*\w")
# Folders of results that no suite of ``python -m benchmarks`` writes (a shell script's output).
OTHER_FOLDERS = {"gpu_check"}


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def docs_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def test_every_result_is_named_by_suite_date_and_commit() -> None:
    wrong = []
    for path in result_files():
        folder = path.parent.relative_to(RESULTS).as_posix()
        match = NAME.match(path.name)
        names = {folder, *COMMANDS} if folder == "scheduling" else {folder}
        if (
            folder not in {*SUITES, *OTHER_FOLDERS}
            or match is None
            or not any(match["name"] == n or match["name"].startswith(f"{n}-") for n in names)
        ):
            wrong.append(path.relative_to(REPO_ROOT).as_posix())
    assert not wrong, "not <suite>/<name>-<date>-<commit>[-<what>].<ext>:\n" + "\n".join(wrong)


def test_every_result_is_cited_by_a_page() -> None:
    """A figure counts as cited with the result it was drawn from (same stem, ``.json``)."""
    text = docs_text()
    uncited = [
        path.relative_to(REPO_ROOT).as_posix()
        for path in result_files()
        if path.name not in text and path.with_suffix(".json").name not in text
    ]
    assert not uncited, "no page cites these results (cite them or remove them):\n" + "\n".join(
        uncited
    )


def test_every_cited_result_exists() -> None:
    missing = sorted(
        {
            cited
            for cited in CITED.findall(docs_text())
            if re.search(r"\.(json|png|txt)$", cited)
            and "<" not in cited
            and not (REPO_ROOT / cited).exists()
        }
    )
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_a_result_that_records_its_commit_and_date_is_named_after_them() -> None:
    wrong = []
    for path in result_files():
        match = NAME.match(path.name)
        if path.suffix != ".json" or match is None:
            continue
        document = json.loads(path.read_text())
        commit, date = document.get("commit"), str(document.get("date") or "")
        if (commit and commit != match["commit"]) or (date and date[:10] != match["date"]):
            wrong.append(f"{path.relative_to(REPO_ROOT)}: commit {commit}, date {date[:10]}")
    assert not wrong, "\n".join(wrong)
