"""The job's settings as worker environment variables: the one schema between a launcher and
the process torchrun runs (a user's own script above all, ``kfp_elastic.worker.elastic``).

The master (local processes and worker pods alike, ``master/host.py``'s launch plan) sets::

    KFP_ELASTIC_RUN_ID           the run (torchrun --rdzv-id; names every etcd key)
    KFP_ELASTIC_SNAPSHOT_DIR     shared snapshot directory of the run (a volume every pod mounts)
    KFP_ELASTIC_OUTPUT           where rank 0 writes the final model (state_dict, torch.save)
    KFP_ELASTIC_EPOCHS           passes over the data
    KFP_ELASTIC_BATCH_SIZE       samples per worker process and step
    KFP_ELASTIC_LEARNING_RATE    at the base world size
    KFP_ELASTIC_SEED             shuffle and initialization seed
    KFP_ELASTIC_SHUFFLE          1 / 0
    KFP_ELASTIC_SNAPSHOT_EVERY   steps between snapshots; 0 = auto
    KFP_ELASTIC_COLLECTIVE_ABORT NCCL: seconds without a finished step after SIGTERM or a broken
                                 round before the process group is aborted (``worker/device.py``)
    KFP_ELASTIC_ETCD_*           the etcd connection (``kfp_elastic/etcd/settings.py``)

Under a plain ``torchrun --rdzv-backend=elastic-etcd`` the rendezvous plugin hands its etcd
settings (``--rdzv-endpoint``/``--rdzv-conf``) to the workers as ``KFP_ELASTIC_ETCD_*``, the
run id comes from torchrun's ``TORCHELASTIC_RUN_ID``, and anything not set takes the job
contract's default (``kfp_elastic/job_spec.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kfp_elastic import job_spec as contract
from kfp_elastic.job_spec import FINAL_MODEL_FILE, JobSpec

TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _env_name(name: str) -> str:
    return "KFP_ELASTIC_" + name.upper()


@dataclass(frozen=True)
class JobEnv:
    """What a worker process knows about its job; field ``x`` is variable ``KFP_ELASTIC_X``."""

    run_id: str = ""
    snapshot_dir: str = ""
    output: str = ""
    epochs: int = contract.DEFAULT_EPOCHS
    batch_size: int = contract.DEFAULT_BATCH_SIZE
    learning_rate: float = contract.DEFAULT_LEARNING_RATE
    seed: int = contract.DEFAULT_SEED
    shuffle: bool = contract.DEFAULT_SHUFFLE
    snapshot_every: int = contract.DEFAULT_SNAPSHOT_EVERY
    nan_policy: str = contract.DEFAULT_NAN_POLICY
    collective_abort: float = contract.DEFAULT_COLLECTIVE_ABORT_S

    @classmethod
    def of(cls, spec: JobSpec, snapshot_dir: str) -> JobEnv:
        """What the workers of ``spec`` get; ``snapshot_dir``: the run's, as the launcher
        resolved it (the final model goes next to the snapshots)."""
        return cls(
            run_id=spec.run_id,
            snapshot_dir=snapshot_dir,
            output=os.path.join(snapshot_dir, FINAL_MODEL_FILE) if snapshot_dir else "",
            epochs=spec.data.epochs,
            batch_size=spec.training.batch_size,
            learning_rate=spec.training.learning_rate,
            seed=spec.data.seed,
            shuffle=spec.data.shuffle,
            snapshot_every=spec.training.snapshot_every,
            nan_policy=spec.training.nan_policy,
            collective_abort=spec.training.collective_abort_s,
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
            kind = type(getattr(cls, f.name))
            try:
                if kind is bool:
                    if text.lower() not in (*_TRUE, *_FALSE):
                        raise ValueError("expected 1 or 0")
                    values[f.name] = text.lower() in _TRUE
                else:
                    values[f.name] = kind(text)
            except ValueError as error:
                raise ValueError(f"{name}={text!r}: {error}") from None
        values.setdefault("run_id", env.get(TORCHRUN_RUN_ID_ENV, ""))
        return cls(**values)  # type: ignore[arg-type]


SNAPSHOT_DIR_ENV = _env_name("snapshot_dir")
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
