"""A worker's settings: the one schema between a launcher and the process torchrun runs (the
built-in runtime, ``python -m kfp_elastic.worker``, and a user's own script through
``kfp_elastic.worker.elastic`` alike).

**Delivered one way: the environment.** Field ``x`` of ``JobEnv`` is variable
``KFP_ELASTIC_X``; the master sets every one for local workers and worker pods
(``JobEnv.of(spec, snapshot_dir).to_env()``, in ``master/host.py``'s launch plan), as it sets
the etcd connection's ``KFP_ELASTIC_ETCD_*`` (``kfp_elastic/etcd/settings.py``). The
environment is the one channel that reaches a user's own script (its command line is the
script's), a worker pod (its spec's ``env``) and every process torchrun restarts alike.

**The flags are generated from the same fields.** The runtime's parser (``worker/options.py``)
gets one flag per field from ``add_arguments`` (``learning_rate`` → ``--lr``, ``shuffle`` →
``--no-shuffle``, others spelled from the field name), with the help text and the variable it
overrides; ``from_args`` reads the environment first and lets each flag given win over it. So a
hand-run ``torchrun ... -m kfp_elastic.worker --model-def M --epochs 3`` keeps working, and the
master's workers need no flag but ``--model-def``.

Under a plain ``torchrun --rdzv-backend=elastic-etcd`` the rendezvous plugin hands its etcd
settings (``--rdzv-endpoint``/``--rdzv-conf``) to the workers as ``KFP_ELASTIC_ETCD_*``, the
run id comes from torchrun's ``TORCHELASTIC_RUN_ID``, and anything not set takes the job
contract's default (``kfp_elastic/job_spec.py``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

from kfp_elastic import job_spec as contract
from kfp_elastic.job_spec import FINAL_MODEL_FILE, JobSpec

TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
ENV_PREFIX = "KFP_ELASTIC_"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _bool(text: str) -> bool:
    if text.lower() not in (*_TRUE, *_FALSE):
        raise ValueError("expected 1 or 0")
    return text.lower() in _TRUE


def parse_snapshot_every(text: str) -> int:
    """``"auto"`` or ``"0"`` (the job contract's auto) → 0, else a positive step count;
    ``ValueError`` with the reason otherwise."""
    if text.strip().lower() in ("auto", str(contract.SNAPSHOT_EVERY_AUTO)):
        return contract.SNAPSHOT_EVERY_AUTO
    try:
        steps = int(text)
    except ValueError:
        raise ValueError(
            f"--snapshot-every must be a number of steps or 'auto', got {text!r}"
        ) from None
    if steps < 1:
        raise ValueError(f"--snapshot-every must be >= 1, or 'auto' (or 0), got {steps}")
    return steps


def _setting(
    default: Any,
    help: str,
    *,
    flag: str | None = "",
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field of ``JobEnv``: its default and help; ``flag``: the runtime's flag when not spelled
    from the field name (None: no flag); ``parse``: text → value when not the default's type;
    ``choices``: the values allowed."""
    metadata = {"help": help, "flag": flag, "parse": parse, "choices": choices}
    return field(default=default, metadata=metadata)


DEFAULT_SNAPSHOT_OVERHEAD = 0.01  # auto: the share of training time snapshots may cost
DEFAULT_SNAPSHOT_MAX_INTERVAL_S = 300.0  # auto: seconds between snapshots at most
# Sharded models: where a node keeps its ranks' shards and its neighbours' copies (tmpfs: host
# memory charged to the pod, gone with it), and how often a snapshot also goes to disk.
DEFAULT_MEMORY_SNAPSHOT_DIR = "/dev/shm/kfp-elastic"
DEFAULT_DISK_SNAPSHOT_EVERY = 10
SHARDED_SNAPSHOT_MODES = ("memory", "disk")
DEFAULT_SHARDED_SNAPSHOTS = "memory"


@dataclass(frozen=True)
class JobEnv:
    """What a worker process knows about its job: field ``x`` is variable ``KFP_ELASTIC_X`` and,
    in the runtime, a flag (module doc). Defaults are the job contract's."""

    run_id: str = _setting(
        "",
        "the run (torchrun --rdzv-id; names every etcd key), else $TORCHELASTIC_RUN_ID",
        flag=None,
    )
    snapshot_dir: str = _setting("", "persisted snapshots (a PVC in a cluster); required")
    local_snapshot_dir: str = _setting("", "fast node-local copy")
    memory_snapshot_dir: str = _setting(
        DEFAULT_MEMORY_SNAPSHOT_DIR,
        "sharded models: host memory (tmpfs) for each rank's shards and its neighbour's copy",
    )
    sharded_snapshots: str = _setting(
        DEFAULT_SHARDED_SNAPSHOTS,
        "sharded models: memory (every rank's shards in host memory, a copy on another node, "
        "N -> M reshard from memory) or disk (every snapshot a DCP save to --snapshot-dir)",
        choices=SHARDED_SNAPSHOT_MODES,
    )
    disk_snapshot_every: int = _setting(
        DEFAULT_DISK_SNAPSHOT_EVERY,
        "sharded models: every Nth snapshot also goes to --snapshot-dir (DCP); 0: never",
    )
    output: str = _setting("", "write the final model state_dict here")
    epochs: int = _setting(contract.DEFAULT_EPOCHS, "passes over the data")
    batch_size: int = _setting(
        contract.DEFAULT_BATCH_SIZE, "samples per worker process and step, at the base size"
    )
    learning_rate: float = _setting(
        contract.DEFAULT_LEARNING_RATE, "at the base world size", flag="--lr"
    )
    batch_policy: str = _setting(
        contract.DEFAULT_BATCH_POLICY, "fixed-global-batch | linear | sqrt", flag="--policy"
    )
    base_world_size: int = _setting(0, "world size the policy scales from (default: the first one)")
    shard_size: int = _setting(0, "samples per shard")
    seed: int = _setting(contract.DEFAULT_SEED, "shuffle and initialization seed")
    shuffle: bool = _setting(
        contract.DEFAULT_SHUFFLE,
        "keep the shards in order when this worker publishes the manifest (no master)",
        flag="--no-shuffle",
    )
    snapshot_every: int = _setting(
        contract.DEFAULT_SNAPSHOT_EVERY,
        "steps between snapshots, or auto (or 0): as often as --snapshot-overhead allows",
        parse=parse_snapshot_every,
    )
    snapshot_overhead: float = _setting(
        DEFAULT_SNAPSHOT_OVERHEAD, "auto: share of training time snapshots may cost"
    )
    snapshot_max_interval: float = _setting(
        DEFAULT_SNAPSHOT_MAX_INTERVAL_S, "auto: seconds between snapshots at most"
    )
    step_time: float = _setting(contract.DEFAULT_STEP_TIME_S, "min seconds per step")
    nan_policy: str = _setting(
        contract.DEFAULT_NAN_POLICY,
        "a NaN/inf loss: fail (the job fails, naming the step and rank) or skip the step",
        choices=contract.NAN_POLICIES,
    )
    device: str = _setting(
        contract.DEFAULT_DEVICE,
        "auto: LOCAL_RANK's accelerator if the node has one, else the CPU",
        choices=contract.DEVICES,
    )
    collective_timeout: float = _setting(
        contract.DEFAULT_COLLECTIVE_TIMEOUT_S, "seconds one collective may take before it fails"
    )
    collective_abort: float = _setting(
        contract.DEFAULT_COLLECTIVE_ABORT_S,
        "NCCL: seconds without a finished step after SIGTERM or a broken rendezvous round "
        "before the communicators are aborted (a peer died) and the rescue written",
    )

    @classmethod
    def of(cls, spec: JobSpec, snapshot_dir: str) -> JobEnv:
        """What the workers of ``spec`` get; ``snapshot_dir``: the run's, as the launcher
        resolved it (the final model goes next to the snapshots)."""
        t, d = spec.training, spec.data
        return cls(
            run_id=spec.run_id,
            snapshot_dir=snapshot_dir,
            output=os.path.join(snapshot_dir, FINAL_MODEL_FILE) if snapshot_dir else "",
            epochs=d.epochs,
            batch_size=t.batch_size,
            learning_rate=t.learning_rate,
            batch_policy=t.batch_policy,
            seed=d.seed,
            shuffle=d.shuffle,
            snapshot_every=t.snapshot_every,
            step_time=t.step_time,
            nan_policy=t.nan_policy,
            device=t.device,
            collective_timeout=t.collective_timeout_s,
            collective_abort=t.collective_abort_s,
        )

    def to_env(self) -> dict[str, str]:
        """The variables (empty settings left out)."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                value = int(value)
            if value != "":
                env[_env_name(f.name)] = str(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnv:
        """The settings in ``env`` (this process's by default); ``ValueError`` names the
        variable that does not parse."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            name = _env_name(f.name)
            text = env.get(name, "").strip()
            if not text:
                continue
            try:
                values[f.name] = _parser(f)(text)
            except ValueError as error:
                raise ValueError(f"{name}={text!r}: {error}") from None
        values.setdefault("run_id", env.get(TORCHRUN_RUN_ID_ENV, ""))
        return cls(**values)  # type: ignore[arg-type]


def flag_of(name: str) -> str | None:
    """The runtime's flag of field ``name`` (None: it has none)."""
    flag = JobEnv.__dataclass_fields__[name].metadata["flag"]
    return "--" + name.replace("_", "-") if flag == "" else flag


def env_of(name: str) -> str:
    """The variable of field ``name``."""
    return _env_name(name)


def _parser(f: Field[Any]) -> Callable[[str], Any]:
    """Text → the field's value: its own ``parse``, else by its default's type; ``choices``
    checked."""
    kind = type(f.default)
    convert = f.metadata["parse"] or (_bool if kind is bool else kind)
    choices = f.metadata["choices"]

    def parsed(text: str) -> Any:
        value = convert(text)
        if choices and value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field that has one (``flag_of``), each defaulting to its variable."""
    for f in fields(JobEnv):
        flag = flag_of(f.name)
        if flag is None:
            continue
        where = f"[env {_env_name(f.name)}]"
        if isinstance(f.default, bool):
            parser.add_argument(
                flag,
                dest=f.name,
                action="store_const",
                const=not f.default,
                default=None,
                help=f"{f.metadata['help']} {where}",
            )
            continue
        parse = f.metadata["parse"]
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            type=_argparse_type(parse) if parse else type(f.default),
            choices=f.metadata["choices"],
            help=f"{f.metadata['help']} {where} (default: {f.default})",
        )


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its own message in argparse's error (not "invalid ... value")."""

    def converted(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return converted


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> JobEnv:
    """The settings from ``env`` (this process's by default) with every flag ``add_arguments``
    added that was given over them."""
    settings = JobEnv.from_env(env)
    given = {
        f.name: getattr(args, f.name)
        for f in fields(JobEnv)
        if getattr(args, f.name, None) is not None
    }
    return replace(settings, **given)


SNAPSHOT_DIR_ENV = _env_name("snapshot_dir")
MEMORY_DIR_ENV = _env_name("memory_snapshot_dir")

#: The rendezvous round a worker was started in: set by the elastic-etcd handler in its agent
#: (inherited by the workers torchrun starts), read through :func:`rendezvous_round`.
ROUND_ENV = "KFP_ELASTIC_RDZV_ROUND"


def rendezvous_round(env: Mapping[str, str] = os.environ) -> int | None:
    """The round this worker's world was formed in (None: not started by the elastic-etcd
    handler, or not a round number)."""
    text = env.get(ROUND_ENV, "").strip()
    return int(text) if text.isdigit() else None


#: Which worker an agent (and its workers) runs, in the master's words: the local launcher sets
#: the first, a pod has its name in the second (downward API).
WORKER_NAME_VARS = ("KFP_ELASTIC_WORKER_NAME", "POD_NAME")


def worker_name(environ: Mapping[str, str] = os.environ) -> str | None:
    """The master's name for the worker this process belongs to (None: not started by one)."""
    return next((environ[v] for v in WORKER_NAME_VARS if environ.get(v)), None)


RUN_ID_ENV = _env_name("run_id")
