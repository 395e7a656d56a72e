"""``benchmarks/harness.py``'s pure parts: where a result goes, the summary table, and that a
``--quick`` run cannot be pointed at the committed results."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.harness import (
    RESULTS,
    add_common_options,
    comma_list,
    git_commit,
    parse_options,
    result_path,
    summary_rows,
    summary_table,
)


def test_result_path_is_per_suite_with_date_and_commit() -> None:
    assert result_path(Path("/r"), "runtime", "2026-11-26", "abc1234") == Path(
        "/r/runtime/runtime-2026-11-26-abc1234.json"
    )


def test_commit_is_short_and_outside_a_checkout_unknown(tmp_path: Path) -> None:
    commit, _ = git_commit()
    assert 4 <= len(commit) <= 12 and commit != "unknown"
    assert git_commit(tmp_path) == ("unknown", False)


def test_summary_table_flattens_nested_names_and_shows_missing_values() -> None:
    summary = {"a": 1.5, "b": None, "c": {"d": 2, "e": {"f": "3/3"}}, "ok": True}
    assert summary_rows(summary) == [
        ("a", "1.5"),
        ("b", "-"),
        ("c.d", "2"),
        ("c.e.f", "3/3"),
        ("ok", "True"),
    ]
    lines = summary_table("suite", summary).splitlines()
    assert lines[0] == "summary: suite"
    assert lines[3].split() == ["c.d", "2"]
    assert "nothing measured" in summary_table("suite", {})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_common_options(p, "shorter")
    return p


@pytest.mark.parametrize("out", [RESULTS / "x.json", RESULTS / "runtime" / "x.json"])
def test_quick_refuses_an_out_among_the_committed_results(out: Path) -> None:
    p = parser()
    with pytest.raises(SystemExit):
        parse_options(p, ["--quick", "--out", str(out)])


def test_quick_elsewhere_and_full_runs_anywhere_are_fine(tmp_path: Path) -> None:
    p = parser()
    parse_options(p, ["--quick", "--out", str(tmp_path / "x.json")])
    parse_options(p, ["--out", str(RESULTS / "x.json")])
    args = p.parse_args([])
    assert (args.quick, args.out) == (False, None)


def test_comma_lists_drop_blanks_and_spaces() -> None:
    assert comma_list(" a, b,,c ") == ["a", "b", "c"] and comma_list("") == []


def test_a_result_names_the_checkout_its_run_started_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A commit made while a long run went on (results of another run, say) must not name it,
    # and the change in between is flagged.
    checkouts = iter([("aaa1111", False), ("bbb2222", False)])
    monkeypatch.setattr(harness, "git_commit", lambda repo=harness.REPO_ROOT: next(checkouts))
    args = parse_options(parser(), ["--out", str(tmp_path / "r.json")])
    out = harness.write_result("suite", args, time.time(), True, {}, {})
    document = json.loads(out.read_text())
    assert (document["commit"], document["uncommitted_changes"]) == ("aaa1111", True)
    assert not any(key.startswith("_") for key in document["settings"])


def test_a_result_records_its_paths_relative_to_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A committed result names no machine's directories: a path in the checkout as from its
    # root (a relative option read from the working directory), one outside it as ../...
    monkeypatch.chdir(harness.REPO_ROOT / "benchmarks")
    p = parser()
    p.add_argument("--trace", type=Path)
    argv = ["--out", str(tmp_path / "r.json"), "--trace", "scheduling/data/philly.csv.gz"]
    out = harness.write_result("suite", parse_options(p, argv), time.time(), True, {}, {})
    settings = json.loads(out.read_text())["settings"]
    assert settings["trace"] == "benchmarks/scheduling/data/philly.csv.gz"
    assert settings["out"].startswith("../") and settings["out"].endswith("/r.json")
    assert (harness.REPO_ROOT / settings["out"]).resolve() == out.resolve()
    assert harness.recorded_path(harness.REPO_ROOT) == "."
