"""``python -m benchmarks <suite> [--quick] [suite options]``: run one benchmark suite.

``python -m benchmarks <suite> --help`` shows a suite's options and what it measures.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import SUITES, suite_module


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: a suite name, then that suite's own options."""
    lines = [f"  {name:<12}{suite_module(name).__doc__.splitlines()[0]}" for name in SUITES]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="suites:\n" + "\n".join(lines) + "\n\n" + __doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("suite", choices=list(SUITES), help="the suite to run")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return suite_module(args.suite).main(args.options)


if __name__ == "__main__":
    sys.exit(main())
