"""Scheduling a shared GPU cluster: gang against elastic jobs (docs/scheduling.md).

    python -m benchmarks scheduling exp1 --quick
    python -m benchmarks scheduling simulate --gpus 64 --jobs 160 \\
        --start-hour 8 --window-hours 8 --seed 1 --policies gang,elastic --json out.json
    python -m benchmarks scheduling --quick     # simulate --quick: a tiny run

Subcommands (``python -m benchmarks scheduling <subcommand> --help``):

  exp1        two jobs on six slots, gang against elastic (docs/scheduling.md, "Experiment 1")
  admission   a job arrives in a full cluster: elastic, gang, whole-job eviction ("Admission")
  exp2        serving beside training on the test cluster ("Experiment 2")
  convergence real training, gang against elastic (LR x world, step decay): the same accuracy?
  ladder      short jobs beside a long one: the least-attained-service ladder against elastic
              FIFO on the test cluster ("Short jobs beside a long one")
  steady      a steady load (Poisson arrivals) in the simulator: gang, Tiresias, elastic, the
              ladder, over a window without warm-up and drain ("Steady load")
  simulate    a discrete-event simulation of a GPU cluster replaying a trace; the default when
              the options start without a subcommand ("Simulation")"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.scheduling import admission, convergence, exp1, exp2, short_jobs, simulate, steady

# subcommand -> its module (each has build_parser(), parse_args(argv), main(argv))
COMMANDS = {
    "exp1": exp1,
    "admission": admission,
    "exp2": exp2,
    "convergence": convergence,
    "ladder": short_jobs,
    "simulate": simulate,
    "steady": steady,
}
DEFAULT_COMMAND = "simulate"


def build_parser() -> argparse.ArgumentParser:
    """The suite's parser: a subcommand, then its options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks scheduling",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("command", choices=list(COMMANDS), help="the subcommand")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="its options")
    return parser


def _split(argv: Sequence[str] | None) -> tuple[str, list[str]]:
    argv = list(argv or [])
    if argv and argv[0] in ("-h", "--help"):
        build_parser().parse_args(argv)  # prints the help, exits
    if argv and not argv[0].startswith("-"):
        args = build_parser().parse_args(argv)
        return args.command, args.options
    return DEFAULT_COMMAND, argv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options of the subcommand ``argv`` names (``simulate`` when it names none)."""
    command, options = _split(argv)
    return COMMANDS[command].parse_args(options)


def main(argv: Sequence[str] | None = None) -> int:
    command, options = _split(argv)
    return COMMANDS[command].main(options)
