"""The ``torchrun.handlers`` entry point, kept free of torch imports.

torch loads entry points while ``torch.distributed.elastic.rendezvous`` is being imported, which
may itself be happening inside an import of :mod:`rendezvous.handler`; so the creator returned
here imports the handler only when torchrun calls it.
"""

from __future__ import annotations

import logging
import os
from typing import Any


def _show_logs_under_torchrun() -> None:
    """torchrun shows only its own loggers; make ours visible (``KFP_ELASTIC_LOG_LEVEL``)."""
    package_logger = logging.getLogger("kfp_elastic.rendezvous")
    if package_logger.handlers:
        return
    stream = logging.StreamHandler()
    stream.setFormatter(
        logging.Formatter("[%(asctime)s] elastic-etcd %(levelname)s %(name)s: %(message)s")
    )
    package_logger.addHandler(stream)
    package_logger.setLevel(os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO").upper())
    package_logger.propagate = False


def create_handler(params: Any) -> Any:
    """``(RendezvousParameters) -> ElasticEtcdRendezvousHandler`` for torch's registry.

    The settings are read first (light imports) so that the zygote is forked before the
    handler imports the etcd client (gRPC, protobuf: ≈ 0.25 s): the zygote's own imports are
    what a new node's first worker waits for.
    """
    from kfp_elastic.contract.rendezvous_config import config_from_torch_params

    config = config_from_torch_params(params)
    hand_etcd_settings_to_workers(config.etcd)
    if config.warm_start:
        from kfp_elastic.rendezvous import warm_start

        warm_start.install(warm_start.DEFAULT_PRELOAD + config.preload_modules)
    from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler

    return ElasticEtcdRendezvousHandler(config)


def hand_etcd_settings_to_workers(etcd: Any, environ: Any = os.environ) -> None:
    """Workers inherit the agent's environment: give them this agent's etcd settings as the
    ``KFP_ELASTIC_ETCD_*`` variables (``kfp_elastic/job_env.py``), so that the runtime and a
    script's ``kfp_elastic.worker.elastic`` reach the same etcd under a plain torchrun with
    ``--rdzv-conf``. Variables already set (by a master) are kept."""
    from kfp_elastic.etcd.settings import ConfigError

    try:
        variables = etcd.to_env()
    except ConfigError as error:  # a password not from a file cannot be handed on
        logging.getLogger(__name__).warning("workers get no etcd settings: %s", error)
        return
    for name, value in variables.items():
        environ.setdefault(name, value)


def entry_point() -> Any:
    """Zero-argument callable returning the creator (torch >= 2.6 plugin protocol)."""
    _show_logs_under_torchrun()
    return create_handler
