"""Command line of ``python -m kfp_elastic.worker`` (see ``docs/runtime.md``).

The one parser of the runtime's command line: the worker parses its command line with it, and
the master runs it over the command it will hand the workers (``master/preflight.py``) before
any worker starts, with the environment the workers will get. Its flags are generated from the
worker's settings (``kfp_elastic/job_env.py``, ``JobEnv``) and the etcd connection's
(``kfp_elastic/etcd/settings.py``); each overrides its ``KFP_ELASTIC_*`` variable, which is how
the master delivers them. Only ``--model-def`` is the runtime's own: what it runs, like the
script path of a command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from kfp_elastic import job_env
from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import SNAPSHOT_DIR_ENV, JobEnv
from kfp_elastic.worker.policy import BatchPolicy


class OptionsError(ValueError):
    """The runtime's command line is wrong; the message is argparse's (it names the flag)."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """Raises ``OptionsError`` instead of printing and exiting: the worker records it for the
    master (torchrun's error file), the master's check reports it as it is."""

    def error(self, message: str) -> NoReturn:
        raise OptionsError(message, self.format_usage())


@dataclass(frozen=True)
class RuntimeOptions:
    """What the runtime's command line and environment say: the model definition it trains,
    the job's settings and the etcd connection."""

    model_def: str
    settings: JobEnv
    etcd: EtcdSettings


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kfp-elastic worker",
        description="The elastic training loop behind "
        "torchrun ... -m kfp_elastic.worker --model-def M. Every setting flag overrides its "
        "KFP_ELASTIC_* variable.",
    )
    parser.add_argument("--model-def", required=True, help="module with model/loss/dataset")
    job_env.add_arguments(parser)
    # The master hands its etcd settings to every worker as KFP_ELASTIC_ETCD_* variables.
    etcd_settings.add_arguments(parser)
    return parser


def parse_args(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> RuntimeOptions:
    """The runtime's settings from ``argv`` (this process's arguments by default) over ``env``
    (this process's environment by default); ``OptionsError`` says what is wrong."""
    env = os.environ if env is None else env
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = job_env.from_args(args, env)
    except ValueError as error:
        parser.error(str(error))
    try:
        etcd = etcd_settings.from_args(args, env)
    except etcd_settings.ConfigError as error:
        parser.error(str(error))
    if not settings.snapshot_dir:
        parser.error(f"--snapshot-dir (or {SNAPSHOT_DIR_ENV}) is required")
    if min(settings.epochs, settings.batch_size) < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    if min(settings.collective_timeout, settings.collective_abort) <= 0:
        parser.error("--collective-timeout and --collective-abort must be > 0")
    if not 0 < settings.snapshot_overhead < 1 or settings.snapshot_max_interval <= 0:
        parser.error("--snapshot-overhead must be in (0, 1) and --snapshot-max-interval > 0")
    try:
        BatchPolicy.parse(settings.batch_policy)
    except ValueError as error:
        parser.error(f"--policy: {error}")
    return RuntimeOptions(args.model_def, settings, etcd)
