"""Settings of the elastic-etcd backend, parsed from torchrun's ``--rdzv-endpoint/--rdzv-conf``.

Every timeout is a named setting in seconds (floats allowed). Parsing is pure: it never touches
the network, so bad input fails at once with a message naming the key and what is allowed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from kfp_elastic.etcd.keys import run_prefix_of

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/kfp-elastic"

# Keys torchrun itself may put into the config; accepted so that a plain torchrun call works.
_TORCHRUN_KEYS = {"timeout"}
# Keys other backends use; named in the error so users switching from c10d know what happened.
_OTHER_BACKEND_KEYS = {"is_host", "read_timeout", "use_libuv", "store_type", "rank"}


class ConfigError(ValueError):
    """A ``--rdzv-endpoint`` or ``--rdzv-conf`` value that cannot be used."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    secure: bool = False

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RendezvousConfig:
    """All settings; ``from_params`` documents where each comes from."""

    endpoints: tuple[Endpoint, ...]
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
    # Liveness: a node whose lease is not refreshed for this long is dead (etcd clamps to >= 2).
    lease_ttl: float = 5.0
    # Per-request deadline for etcd calls; also bounds the connectivity check at start.
    request_timeout: float = 5.0
    # Detect a dead peer at once through a TCP probe connection (lease expiry is the fallback).
    peer_probe: bool = True
    # A worker failure within this long of a membership change (a peer died) restarts the
    # workers without spending one of --max-restarts; 0 counts every failure, as torch does.
    peer_failure_grace: float = 1.0
    # Close the run for everyone when a failing agent shuts down (torch's behaviour).
    close_on_failure: bool = False
    # How many ring successors each node probes.
    probe_fanout: int = 2
    key_prefix: str = DEFAULT_KEY_PREFIX
    # Fork restarted workers from a process with torch imported (rendezvous/zygote.py).
    warm_start: bool = True
    # Modules the zygote imports besides torch, torch.distributed, DDP, dynamo and torch.optim;
    # ':'-separated (e.g. ``transformers:worker.runner``).
    warm_start_preload: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def run_prefix(self) -> str:
        return run_prefix_of(self.key_prefix, self.run_id)

    @property
    def preload_modules(self) -> tuple[str, ...]:
        return tuple(name for name in (self.warm_start_preload or "").split(":") if name)

    @property
    def uses_tls(self) -> bool:
        return self.cacert is not None or any(endpoint.secure for endpoint in self.endpoints)

    @classmethod
    def setting_names(cls) -> list[str]:
        fixed = {"endpoints", "run_id", "min_nodes", "max_nodes", "local_addr"}
        return [f.name for f in fields(cls) if f.name not in fixed]

    @classmethod
    def from_params(
        cls,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None,
        conf: dict[str, Any],
    ) -> RendezvousConfig:
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ConfigError(f"--nnodes={min_nodes}:{max_nodes} is invalid: need 1 <= MIN <= MAX")
        if not run_id or not re.fullmatch(r"[A-Za-z0-9._-]+", run_id):
            raise ConfigError(
                f"--rdzv-id={run_id!r} is invalid: use letters, digits, '.', '_' or '-'"
            )
        values = _typed_conf(conf)
        endpoints = parse_endpoints(endpoint)
        config = cls(
            endpoints=endpoints,
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
            "request_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(self, name)} must be > 0")
        if self.peer_failure_grace < 0:
            raise ConfigError(
                f"--rdzv-conf peer_failure_grace={self.peer_failure_grace} must be >= 0"
            )
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
        if not self.key_prefix.startswith("/"):
            raise ConfigError(f"--rdzv-conf key_prefix={self.key_prefix!r} must start with '/'")
        if (self.user is None) != (self.password is None):
            raise ConfigError("--rdzv-conf needs both user and password, or neither")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--rdzv-conf needs both cert and key (client TLS), or neither")
        if self.cert is not None and self.cacert is None:
            raise ConfigError("--rdzv-conf cert/key need cacert too")
        if any(e.secure for e in self.endpoints) and self.cacert is None:
            raise ConfigError("an https:// endpoint needs --rdzv-conf cacert=FILE")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"--rdzv-conf {name}={path}: no such file")


_FLOAT_KEYS = {
    "join_timeout",
    "last_call_timeout",
    "rejoin_timeout",
    "close_timeout",
    "lease_ttl",
    "request_timeout",
    "peer_failure_grace",
}
_INT_KEYS = {"probe_fanout"}
_BOOL_KEYS = {"peer_probe", "close_on_failure", "warm_start"}
_STR_KEYS = {"key_prefix", "cacert", "cert", "key", "user", "password", "warm_start_preload"}
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
        if name not in known:
            hint = " (a c10d/static setting)" if name in _OTHER_BACKEND_KEYS else ""
            raise ConfigError(
                f"unknown --rdzv-conf key {name!r}{hint} for elastic-etcd; "
                f"known keys: {', '.join(sorted(known))}"
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


_ENDPOINT_RE = re.compile(
    r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9a-fA-F:]+\]|[^:/\s]+)"
    r"(?::(?P<port>[^/]*))?/?$"
)


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """``host[:port][,host[:port]...]``, each optionally ``http://`` or ``https://``."""
    if not text or not text.strip():
        raise ConfigError(
            "--rdzv-endpoint is empty: give etcd as HOST:PORT[,HOST:PORT...] "
            "(start one locally with `kfp-elastic etcd`)"
        )
    endpoints = []
    for part in text.split(","):
        part = part.strip()
        match = _ENDPOINT_RE.match(part)
        if not match:
            raise ConfigError(f"--rdzv-endpoint entry {part!r} is not HOST[:PORT]")
        port_text = match.group("port")
        if port_text is None or port_text == "":
            port = DEFAULT_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ConfigError(f"--rdzv-endpoint entry {part!r}: port {port_text!r} is not 1-65535")
        host = match.group("host").strip("[]")
        endpoints.append(Endpoint(host, port, secure=match.group("scheme") == "https"))
    return tuple(endpoints)
