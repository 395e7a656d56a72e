"""``kfp-elastic``: the one console script; each subcommand is a module's ``main(argv)``.

kfp-elastic run-local            the elastic-training pipeline under kfp.local, no cluster
kfp-elastic master ... -- ...    run one elastic job (workers: local processes or pods)
kfp-elastic worker ...           the built-in training runtime (what torchrun starts)
kfp-elastic agent ...            torchrun with a faster start (what the master runs per worker)
kfp-elastic evaluate ...         evaluate a trained model on a model definition's test split
kfp-elastic etcd ...             a throw-away local etcd (TLS on request)
kfp-elastic forget RUN_ID ...    delete a run's etcd keys (its run id can start a new job)
kfp-elastic demo                 the rendezvous alone: three torchrun nodes, 3 -> 2 -> 3
kfp-elastic compile [--check]    compile the KFP components and the pipeline to YAML
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
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
    "demo": Subcommand("kfp_elastic.testing.demo", "three torchrun nodes: one killed, one joining"),
    "compile": Subcommand(
        "kfp_elastic.pipelines.compile", "compile the components and the pipeline to YAML"
    ),
}


def prog(name: str) -> str:
    """The program name a subcommand's own ``--help`` and errors show."""
    return f"kfp-elastic {name}"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
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
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        sys.stderr.write(f"kfp-elastic: unknown subcommand {name!r}\n\n{usage()}")
        return 2
    entry: Callable[[list[str]], int | None] = importlib.import_module(sub.module).main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
