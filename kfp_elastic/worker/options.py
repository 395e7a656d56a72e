"""Command-line options of ``python -m kfp_elastic.worker`` (see ``docs/runtime.md``).

The one parser of the runtime's flags: the worker parses its command line with it, and the
master runs it over the flags it will hand the workers (``master/preflight.py``) before any
worker starts, with the environment the workers will get.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import NoReturn

from kfp_elastic import job_spec as job  # the job contract: the defaults shared with it
from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.job_env import SNAPSHOT_DIR_ENV
from kfp_elastic.worker.policy import BatchPolicy
from kfp_elastic.worker.schedule import parse_snapshot_every


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


def parse_args(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The runtime's settings from ``argv`` (this process's arguments by default) and ``env``
    (this process's environment by default: the snapshot directory and the etcd settings come
    from it when no flag gives them); ``OptionsError`` says what is wrong."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog="kfp-elastic worker",
        description="The elastic training loop behind "
        "torchrun ... -m kfp_elastic.worker --model-def M.",
    )
    parser.add_argument("--model-def", required=True, help="module with model/loss/dataset")
    parser.add_argument("--epochs", type=int, default=job.DEFAULT_EPOCHS)
    parser.add_argument(
        "--batch-size", type=int, default=job.DEFAULT_BATCH_SIZE, help="per worker, at base size"
    )
    parser.add_argument("--lr", type=float, default=job.DEFAULT_LEARNING_RATE)
    parser.add_argument(
        "--policy", default=job.DEFAULT_BATCH_POLICY, help="fixed-global-batch | linear | sqrt"
    )
    parser.add_argument(
        "--base-world-size",
        type=int,
        default=0,
        help="world size the policy scales from (default: the first one)",
    )
    parser.add_argument("--shard-size", type=int, default=0, help="samples per shard")
    parser.add_argument("--seed", type=int, default=job.DEFAULT_SEED)
    parser.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        default=job.DEFAULT_SHUFFLE,
        help="keep the shards in order when this worker publishes the manifest (no master)",
    )
    parser.add_argument(
        "--snapshot-every",
        default=str(job.DEFAULT_SNAPSHOT_EVERY),
        help="steps between snapshots, or auto (or 0): as often as --snapshot-overhead allows",
    )
    parser.add_argument(
        "--snapshot-overhead",
        type=float,
        default=0.01,
        help="auto: share of training time snapshots may cost",
    )
    parser.add_argument(
        "--snapshot-max-interval",
        type=float,
        default=300.0,
        help="auto: seconds between snapshots at most",
    )
    parser.add_argument(
        "--snapshot-dir",
        default=env.get(SNAPSHOT_DIR_ENV),
        help="persisted snapshots (a PVC in a cluster)",
    )
    parser.add_argument("--local-snapshot-dir", default=None, help="fast node-local copy")
    parser.add_argument("--output", help="write the final model state_dict here")
    parser.add_argument(
        "--step-time", type=float, default=job.DEFAULT_STEP_TIME_S, help="min seconds per step"
    )
    parser.add_argument(
        "--nan-policy",
        default=job.DEFAULT_NAN_POLICY,
        choices=job.NAN_POLICIES,
        help="a NaN/inf loss: fail (the job fails, naming the step and rank) or skip the step",
    )
    parser.add_argument(
        "--device",
        default=job.DEFAULT_DEVICE,
        choices=job.DEVICES,
        help="auto: LOCAL_RANK's accelerator if the node has one, else the CPU",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=job.DEFAULT_COLLECTIVE_TIMEOUT_S,
        help="seconds one collective may take before it fails",
    )
    parser.add_argument(
        "--collective-abort",
        type=float,
        default=job.DEFAULT_COLLECTIVE_ABORT_S,
        help="NCCL: seconds without a finished step after SIGTERM or a broken rendezvous round "
        "before the communicators are aborted (a peer died) and the rescue written",
    )
    # The master hands its etcd settings to every worker as KFP_ELASTIC_ETCD_* variables.
    etcd_settings.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.etcd_settings = etcd_settings.from_args(args, env)
    except etcd_settings.ConfigError as error:
        parser.error(str(error))
    if not args.snapshot_dir:
        parser.error(f"--snapshot-dir (or {SNAPSHOT_DIR_ENV}) is required")
    if min(args.epochs, args.batch_size) < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    try:
        args.snapshot_every = parse_snapshot_every(args.snapshot_every)
    except ValueError as error:
        parser.error(str(error))
    if min(args.collective_timeout, args.collective_abort) <= 0:
        parser.error("--collective-timeout and --collective-abort must be > 0")
    if not 0 < args.snapshot_overhead < 1 or args.snapshot_max_interval <= 0:
        parser.error("--snapshot-overhead must be in (0, 1) and --snapshot-max-interval > 0")
    try:
        BatchPolicy.parse(args.policy)
    except ValueError as error:
        parser.error(f"--policy: {error}")
    return args
