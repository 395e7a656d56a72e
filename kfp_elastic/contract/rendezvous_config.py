"""Settings of the elastic-etcd backend, parsed from torchrun's ``--rdzv-endpoint/--rdzv-conf``.

The rendezvous (``kfp_elastic/rendezvous/``) runs with them; the job contract refuses a job's
``rdzv_conf`` with the same parser before any agent starts (``JobSpec.validate``).

Every timeout is a named setting in seconds (floats allowed). Parsing is pure: it never touches
the network, so bad input fails at once with a message naming the key and what is allowed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_PORT,
    ConfigError,
    Endpoint,
    EtcdSettings,
    parse_endpoints,
)

# A live peer's listener accepts at once; one that does not within this is unreachable (not
# declared dead: its lease decides). The default of ``--rdzv-conf probe_connect_timeout``.
PROBE_CONNECT_TIMEOUT_S = 1.0

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_PORT",
    "ConfigError",
    "Endpoint",
    "EtcdSettings",
    "RendezvousConfig",
    "config_from_torch_params",
    "parse_endpoints",
]

# torch's TCPStore default timeout: how long its blocking get/wait wait.
DEFAULT_STORE_TIMEOUT_S = 300.0

# Keys torchrun itself may put into the config; accepted so that a plain torchrun call works.
_TORCHRUN_KEYS = {"timeout"}
# Keys other backends use; named in the error so users switching from c10d know what happened.
_OTHER_BACKEND_KEYS = {"is_host", "read_timeout", "use_libuv", "store_type", "rank"}
# --rdzv-conf keys that are etcd connection settings (EtcdSettings); a key not given there is
# taken from its KFP_ELASTIC_ETCD_* variable, so a master can configure agents through env alone.
# (The endpoints come as --rdzv-endpoint.)
ETCD_KEYS = tuple(s.name for s in etcd_settings.SETTINGS if s.name != "endpoints")


@dataclass(frozen=True)
class RendezvousConfig:
    """All settings; ``from_params`` documents where each comes from."""

    etcd: EtcdSettings
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    # How long a node waits for a round it can join before giving up (torch's name).
    join_timeout: float = 600.0
    # After min nodes wait for the first round, how long to wait for more (torch's name).
    last_call_timeout: float = 1.0
    # Later rounds: how long to wait for members of the previous round to come back (a member
    # that does not is hung: its agent lives but does not restart).
    rejoin_timeout: float = 30.0
    # How long a node that finished keeps waiting for others in shutdown (torch's name).
    close_timeout: float = 30.0
    # How long a node whose workers succeeded waits at torch's exit barrier for the other nodes'
    # workers to end (torch: 300 s); then it exits 0, naming the nodes that did not finish.
    exit_barrier_timeout: float = 30.0
    # Liveness: a node whose lease is not refreshed for this long is dead (etcd clamps to >= 2).
    lease_ttl: float = 5.0
    # How long a blocking get/wait of the agent's round store, or a node entering a round
    # waiting for rank 0's MASTER_ADDR/PORT, waits before it fails.
    store_timeout: float = DEFAULT_STORE_TIMEOUT_S
    # Detect a dead peer at once through a TCP probe connection (lease expiry is the fallback).
    peer_probe: bool = True
    # A worker failure within this long of a participant's death or leave restarts the workers
    # without spending one of --max-restarts (rendezvous/peer_failures.py); 0 counts every
    # failure, as torch does.
    peer_failure_grace: float = 1.0
    # At most this many such free restarts per free_restart_window seconds; more are counted.
    max_free_restarts: int = 10
    free_restart_window: float = 300.0
    # The agent gives up (whatever is left of --max-restarts) when its workers fail the same way
    # this many times in a row; 0: only --max-restarts ends it.
    max_repeated_failures: int = 2
    # Close the run for everyone when a failing agent shuts down (torch's behaviour).
    close_on_failure: bool = False
    # How many ring successors each node probes.
    probe_fanout: int = 2
    # How long a probe connection to a peer may take; a peer that does not accept in time is
    # left to its lease (never declared dead), so raise it where connects are slow (a node
    # across a long network path) to keep the fast detection (rendezvous/probe.py).
    probe_connect_timeout: float = PROBE_CONNECT_TIMEOUT_S
    # Fork restarted workers from a process with torch imported (rendezvous/zygote.py).
    warm_start: bool = True
    # Modules the zygote imports besides torch, torch.distributed, DDP, dynamo and torch.optim;
    # ':'-separated (e.g. ``transformers:worker.runner``).
    warm_start_preload: str | None = None
    # Stop this node (a snapshot first, then exit ORPHANED_EXIT_CODE: rendezvous/orphan.py)
    # once its run has had no master for this long. A master sets it for the workers it starts;
    # unset (a plain torchrun job has no master): never.
    orphan_timeout: float | None = None
    # The job's failure budget (``contract/failure_budget.py``): once more than this many
    # failures are counted in etcd for the run (or a fatal one), the agent stops restarting its
    # workers in place. A master sets it to the job's ``max_failures``; unset: only fatal
    # failures and torchrun's --max-restarts end the restarts.
    max_failures: int | None = None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.etcd.endpoints

    @property
    def key_prefix(self) -> str:
        return self.etcd.key_prefix

    @property
    def request_timeout(self) -> float:
        """Per-request deadline for etcd calls; also bounds the connectivity check at start."""
        return self.etcd.request_timeout

    @property
    def run_prefix(self) -> str:
        return self.etcd.run_prefix(self.run_id)

    @property
    def preload_modules(self) -> tuple[str, ...]:
        return tuple(name for name in (self.warm_start_preload or "").split(":") if name)

    @classmethod
    def setting_names(cls) -> list[str]:
        """Every ``--rdzv-conf`` key."""
        fixed = {"etcd", "run_id", "min_nodes", "max_nodes", "local_addr"}
        return [f.name for f in fields(cls) if f.name not in fixed] + list(ETCD_KEYS)

    @classmethod
    def from_params(
        cls,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None,
        conf: dict[str, Any],
        env: Mapping[str, str] | None = None,
    ) -> RendezvousConfig:
        """``conf`` is ``--rdzv-conf``; etcd settings it lacks come from ``env`` (os.environ)."""
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ConfigError(f"--nnodes={min_nodes}:{max_nodes} is invalid: need 1 <= MIN <= MAX")
        if not run_id or not re.fullmatch(r"[A-Za-z0-9._-]+", run_id):
            raise ConfigError(
                f"--rdzv-id={run_id!r} is invalid: use letters, digits, '.', '_' or '-'"
            )
        values = _typed_conf({k: v for k, v in conf.items() if k not in ETCD_KEYS})
        etcd = etcd_settings.from_sources(
            {"endpoints": endpoint, **{k: str(v) for k, v in conf.items() if k in ETCD_KEYS}},
            os.environ if env is None else env,
            {"endpoints": "--rdzv-endpoint", **{k: f"--rdzv-conf {k}" for k in ETCD_KEYS}},
        )
        config = cls(
            etcd=etcd,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=local_addr,
            **values,
        )
        config.validate()
        return config

    def validate(self) -> None:
        for name in (
            "join_timeout",
            "last_call_timeout",
            "rejoin_timeout",
            "close_timeout",
            "exit_barrier_timeout",
            "store_timeout",
            "probe_connect_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(self, name)} must be > 0")
        if self.peer_failure_grace < 0:
            raise ConfigError(
                f"--rdzv-conf peer_failure_grace={self.peer_failure_grace} must be >= 0"
            )
        for name in ("max_free_restarts", "max_repeated_failures", "max_failures"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(self, name)} must be >= 0")
        if self.free_restart_window <= 0:
            raise ConfigError(
                f"--rdzv-conf free_restart_window={self.free_restart_window} must be > 0"
            )
        if self.orphan_timeout is not None and self.orphan_timeout <= 0:
            raise ConfigError(f"--rdzv-conf orphan_timeout={self.orphan_timeout} must be > 0")
        if self.lease_ttl < 2:
            raise ConfigError(
                f"--rdzv-conf lease_ttl={self.lease_ttl} is below etcd's minimum of 2 seconds"
            )
        if self.probe_fanout < 1:
            raise ConfigError(f"--rdzv-conf probe_fanout={self.probe_fanout} must be >= 1")
        for module in self.preload_modules:
            if not _MODULE_RE.fullmatch(module):
                raise ConfigError(
                    f"--rdzv-conf warm_start_preload: {module!r} is not a module name "
                    "(use ':' between modules, e.g. transformers:mypkg.model)"
                )
        self.etcd.validate()


_FLOAT_KEYS = {
    "join_timeout",
    "last_call_timeout",
    "rejoin_timeout",
    "close_timeout",
    "exit_barrier_timeout",
    "lease_ttl",
    "store_timeout",
    "peer_failure_grace",
    "free_restart_window",
    "orphan_timeout",
    "probe_connect_timeout",
}
_INT_KEYS = {"probe_fanout", "max_free_restarts", "max_repeated_failures", "max_failures"}
_BOOL_KEYS = {"peer_probe", "close_on_failure", "warm_start"}
_STR_KEYS = {"warm_start_preload"}
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def config_from_torch_params(params: Any) -> RendezvousConfig:
    """The settings in torch's ``RendezvousParameters``; ``ValueError`` says what is wrong."""
    try:
        return RendezvousConfig.from_params(
            endpoint=params.endpoint,
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=params.local_addr,
            conf=dict(params.config),
        )
    except ConfigError as error:
        raise ValueError(f"elastic-etcd: {error}") from None


def _typed_conf(conf: dict[str, Any]) -> dict[str, Any]:
    known = _FLOAT_KEYS | _INT_KEYS | _BOOL_KEYS | _STR_KEYS
    values: dict[str, Any] = {}
    for name, raw in conf.items():
        if name in _TORCHRUN_KEYS:
            continue
        if name == "password":
            raise ConfigError(
                "--rdzv-conf password is not accepted: a command line is visible to everyone "
                "on the machine; use password_file=FILE (or KFP_ELASTIC_ETCD_PASSWORD_FILE)"
            )
        if name not in known:
            hint = " (a c10d/static setting)" if name in _OTHER_BACKEND_KEYS else ""
            raise ConfigError(
                f"unknown --rdzv-conf key {name!r}{hint} for elastic-etcd; "
                f"known keys: {', '.join(sorted(known | set(ETCD_KEYS)))}"
            )
        values[name] = _convert(name, raw)
    if "timeout" in conf and "join_timeout" not in conf:
        # torchrun always passes its legacy --rdzv-timeout as 'timeout' (default 900).
        values["join_timeout"] = _convert("timeout", conf["timeout"])
    return values


def _convert(name: str, raw: Any) -> Any:
    text = str(raw).strip()
    if name in _FLOAT_KEYS or name == "timeout":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--rdzv-conf {name}={raw!r} is not a number of seconds") from None
    if name in _INT_KEYS:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--rdzv-conf {name}={raw!r} is not an integer") from None
    if name in _BOOL_KEYS:
        if isinstance(raw, bool):
            return raw
        lowered = text.lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"--rdzv-conf {name}={raw!r} is not a boolean (true/false)")
    if not text:
        raise ConfigError(f"--rdzv-conf {name} is empty")
    return text
