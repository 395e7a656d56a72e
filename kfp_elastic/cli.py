"""``kfp-elastic``: the one console script; each subcommand is a module's ``main(argv)``.

kfp-elastic run-local            the elastic-training pipeline under kfp.local, no cluster
kfp-elastic master ... -- ...    run one elastic job (workers: local processes or pods)
kfp-elastic worker ...           the built-in training runtime (what torchrun starts)
kfp-elastic agent ...            torchrun with a faster start (what the master runs per worker)
kfp-elastic evaluate ...         evaluate a trained model on a model definition's test split
kfp-elastic etcd ...             a throw-away local etcd (TLS on request)
kfp-elastic forget RUN_ID ...    delete a run's etcd keys (its run id can start a new job)
kfp-elastic compile [--check]    compile the KFP components and the pipeline to YAML
kfp-elastic demo                 the rendezvous alone: three torchrun nodes, 3 -> 2 -> 3

``demo`` is added by the testing package (``kfp_elastic.testing.demo``) through the entry point
group ``kfp_elastic.subcommands`` (pyproject.toml), as any installed package may add one: this
console script is product code and never names the testing package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str
    summary: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "run-local": Subcommand(
        "kfp_elastic.pipelines.run_local",
        "run the elastic-training pipeline under kfp.local (embedded etcd, no cluster)",
    ),
    "master": Subcommand(
        "kfp_elastic.master.cli", "run one elastic job until it succeeds or fails"
    ),
    "worker": Subcommand(
        "kfp_elastic.worker.__main__", "the built-in training runtime (run under torchrun)"
    ),
    "agent": Subcommand(
        "kfp_elastic.rendezvous.agent", "torchrun, started faster (what a worker pod runs)"
    ),
    "evaluate": Subcommand(
        "kfp_elastic.worker.evaluate", "evaluate a trained model on its test split"
    ),
    "etcd": Subcommand("kfp_elastic.etcd.embedded", "a throw-away local etcd"),
    "forget": Subcommand(
        "kfp_elastic.forget", "delete a run's etcd keys (its run id can start a new job)"
    ),
    "compile": Subcommand(
        "kfp_elastic.pipelines.compile", "compile the components and the pipeline to YAML"
    ),
}


#: Where installed packages add subcommands: ``NAME = "MODULE"`` under
#: ``[project.entry-points."kfp_elastic.subcommands"]``, MODULE having ``main(argv)``.
ADDED_SUBCOMMANDS = "kfp_elastic.subcommands"


def added_subcommands(
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
) -> dict[str, Subcommand]:
    """The subcommands installed packages add (``entry_points``: the installed ones of
    ``ADDED_SUBCOMMANDS``); one named like a built-in one is not taken."""
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ADDED_SUBCOMMANDS)
    return {
        point.name: Subcommand(point.module, _summary(point.module))
        for point in entry_points
        if point.name not in SUBCOMMANDS
    }


def _summary(module: str) -> str:
    """The first line of ``module``'s docstring, read without running the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return ""
    with open(spec.origin, encoding="utf-8") as source:
        docstring = ast.get_docstring(ast.parse(source.read())) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def subcommands() -> dict[str, Subcommand]:
    """Every subcommand: the built-in ones, then the added ones."""
    return {**SUBCOMMANDS, **added_subcommands()}


def prog(name: str) -> str:
    """The program name a subcommand's own ``--help`` and errors show."""
    return f"kfp-elastic {name}"


def usage() -> str:
    every = subcommands()
    width = max(map(len, every))
    lines = [f"  {name:<{width}}  {sub.summary}" for name, sub in every.items()]
    return (
        "usage: kfp-elastic SUBCOMMAND [ARGS...]   (kfp-elastic SUBCOMMAND --help)\n\n"
        "Elastic, preemption-proof PyTorch DDP training for Kubeflow Pipelines.\n\n"
        "subcommands:\n" + "\n".join(lines) + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    if args[0] == "--version":
        from kfp_elastic import __version__

        print(f"kfp-elastic {__version__}")
        return 0
    name, rest = args[0], args[1:]
    # A built-in one first: the agent's start (every worker, every join) scans no entry points.
    sub = SUBCOMMANDS.get(name) or added_subcommands().get(name)
    if sub is None:
        sys.stderr.write(f"kfp-elastic: unknown subcommand {name!r}\n\n{usage()}")
        return 2
    entry: Callable[[list[str]], int | None] = importlib.import_module(sub.module).main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
