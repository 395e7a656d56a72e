"""The benchmarks of a checkout (not installed): ``python -m benchmarks <suite> [--quick] ...``
from the repository root. Each suite is a module with ``build_parser()``, ``parse_args(argv)``
and ``main(argv)``; what they share is in ``benchmarks/harness.py``.

Kept light: the workers of a benchmark import ``benchmarks.timed_model_def`` and the other model
definitions here, and with them this file.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# suite name -> its module
SUITES: dict[str, str] = {
    "rendezvous": "benchmarks.rendezvous",
    "runtime": "benchmarks.runtime",
    "cluster": "benchmarks.cluster",
    "chaos": "benchmarks.chaos",
    "scheduling": "benchmarks.scheduling.suite",
    "sharded": "benchmarks.sharded",
}


def suite_module(name: str) -> ModuleType:
    """The module of suite ``name`` (KeyError: no such suite)."""
    return importlib.import_module(SUITES[name])
