"""``kfp-elastic master``: run one elastic job until it succeeds (exit 0) or fails (exit 1).

    kfp-elastic master --run-id job-1 --etcd 127.0.0.1:2379 --min-workers 2 --max-workers 3 \\
        --launcher local --dataset-length 10000 --shard-size 500 --epochs 2 \\
        --workdir /tmp/job-1 -- -m kfp_elastic.worker --model-def my_model.py

The flags are the fields of the job contract (``kfp_elastic/job_spec.py``: its defaults and
help). Each
torchrun agent runs the built-in runtime with ``--model-def M`` (and the training flags), or
everything after ``--``: a script and its arguments, or ``-m MODULE ...``; arguments that start
with ``-`` (other than ``-m``) go to the default entry ``-m kfp_elastic.worker``. Exit codes: 0
succeeded, 1 failed (the message says why), 2 bad arguments or a job that cannot start (its run
id is taken, its model definition does not load, ...: ``master/preflight.py``), 3 stepped down
(SIGTERM or this master's pod being deleted with an external etcd and worker pods, or leadership
lost; the workers keep running for the next master). ``--dry-run`` prints the launch plan
(``master/host.py``) and starts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any, get_args, get_type_hints

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_spec import (
    RUNTIME_MODULE,
    Data,
    Entry,
    JobSpec,
    KubernetesSettings,
    Launch,
    LocalSettings,
    Policy,
    Size,
    Training,
    flag_of,
)
from kfp_elastic.master.host import EMBEDDED, Host, LaunchPlan, plan
from kfp_elastic.master.preflight import PreflightError

log = logging.getLogger("kfp_elastic.master")

_MODULE_FLAGS = ("-m", "--module", "--no-python", "--no_python")


def split_entry(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(master arguments, worker entry) split at the first ``--``; the entry as torchrun gets
    it (``-m kfp_elastic.worker`` when empty or when it starts with options; none without
    ``--``: then ``--model-def`` says what to run)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    rest = argv[cut + 1 :]
    if not rest:
        rest = ["-m", RUNTIME_MODULE]
    elif rest[0].startswith("-") and rest[0] not in _MODULE_FLAGS:
        rest = ["-m", RUNTIME_MODULE, *rest]
    return argv[:cut], rest


def parse_conf(text: str | None, what: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected KEY=VALUE, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def parse_rdzv_conf(text: str) -> dict[str, str]:
    try:
        return parse_conf(text, "--rdzv-conf")
    except ValueError as error:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_fields(group: Any, section: type) -> None:
    """One flag per field of ``section`` that has one, with the contract's default and help."""
    hints = get_type_hints(section)
    for f in fields(section):
        flag = flag_of(f.name, section)
        if flag is None or "help" not in f.metadata:
            continue
        kind = hints[f.name]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        text = f.metadata["help"]
        if kind is bool:  # the flag turns the default off (--no-shuffle)
            group.add_argument(flag, dest=f.name, action="store_false", help=text)
            continue
        if f.name == "rdzv_conf":
            convert: Any = parse_rdzv_conf
        else:
            convert = next((t for t in (int, float, str) if t in get_args(kind) or t is kind), str)
        group.add_argument(flag, dest=f.name, type=convert, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kfp-elastic master",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--run-id", required=True, help="torchrun --rdzv-id; names every etcd key")
    etcd_settings.add_arguments(
        p,
        endpoints_help="etcd as HOST:PORT[,HOST:PORT...] (https:// for TLS), or 'embedded' "
        "for a throw-away local etcd; every worker gets the same etcd settings",
    )
    _add_fields(p.add_argument_group("what to run (or the entry after --)"), Entry)
    _add_fields(p.add_argument_group("size"), Size)
    _add_fields(p.add_argument_group("data (the master publishes the shard manifest)"), Data)
    _add_fields(p.add_argument_group("training (with --model-def)"), Training)
    _add_fields(p.add_argument_group("policy"), Policy)
    launch = p.add_argument_group("launcher")
    _add_fields(launch, Launch)
    _add_fields(p.add_argument_group("local launcher"), LocalSettings)
    _add_fields(p.add_argument_group("kubernetes launcher"), KubernetesSettings)
    p.add_argument("--metrics-port", type=int, help="serve /metrics here (0: a free port)")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the launch plan (etcd mode, signal policy, the worker pods as YAML or the "
        "local processes' commands and environment) and start nothing",
    )
    return p


def make_spec(args: argparse.Namespace, entry: Sequence[str], etcd: EtcdSettings | None) -> JobSpec:
    """The job the parsed flags describe; ``entry``: what followed ``--`` (may be empty);
    ``etcd`` None: an embedded one."""

    def section(cls: type, **more: Any) -> Any:
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**given, **more)

    return JobSpec(
        run_id=args.run_id,
        entry=Entry(model_def=args.model_def or "", command=tuple(entry)),
        size=section(Size),
        data=section(Data),
        training=section(Training),
        etcd=etcd,
        launch=section(
            Launch, local=section(LocalSettings), kubernetes=section(KubernetesSettings)
        ),
        policy=section(Policy),
    )


def launch_plan(args: argparse.Namespace, entry: Sequence[str]) -> LaunchPlan:
    """The launch plan of the parsed flags (``master/host.py``); ``ValueError`` (``ConfigError``
    is one) names the flag at fault. ``--etcd embedded``: an etcd of the master's own."""
    etcd = None if args.etcd == EMBEDDED else etcd_settings.from_args(args)
    return plan(make_spec(args, entry, etcd))


def main(argv: Sequence[str] | None = None) -> int:
    own, entry = split_entry(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        launch = launch_plan(args, entry)
    except ValueError as error:
        parser.exit(2, f"kfp-elastic master: error: {error}\n")
    if args.dry_run:
        sys.stdout.write(launch.describe())
        return 0
    with Host(launch, metrics_port=args.metrics_port, metrics_host=args.metrics_host) as host:
        try:
            result = host.start().run()
        except PreflightError as error:  # the checks before any worker starts
            print(f"result=refused run={launch.spec.run_id} message={error}", flush=True)
            parser.exit(2, f"kfp-elastic master: error: {error}\n")
    print(f"result={result.state} run={launch.spec.run_id} message={result.message}", flush=True)
    if result.state == "refused":
        sys.stderr.write(f"kfp-elastic master: error: {result.message}\n")
    return result.exit_code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
