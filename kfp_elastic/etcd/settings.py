"""How to reach etcd: the one connection setting of agents, master, worker runtime and tools.

Every process reads the same environment variables (flags mirror them and win over them)::

    KFP_ELASTIC_ETCD_ENDPOINTS        --etcd                  HOST:PORT[,...], https:// for TLS
    KFP_ELASTIC_ETCD_CACERT           --etcd-cacert           CA bundle (turns TLS on)
    KFP_ELASTIC_ETCD_CERT             --etcd-cert             client certificate (mutual TLS)
    KFP_ELASTIC_ETCD_KEY              --etcd-key              its private key
    KFP_ELASTIC_ETCD_USER             --etcd-user             etcd user (auth enabled)
    KFP_ELASTIC_ETCD_PASSWORD_FILE    --etcd-password-file    file holding the user's password
    KFP_ELASTIC_ETCD_KEY_PREFIX       --key-prefix            every key lives under it
    KFP_ELASTIC_ETCD_REQUEST_TIMEOUT  --etcd-request-timeout  seconds per etcd request
    KFP_ELASTIC_ETCD_OUTAGE_WAIT      --etcd-outage-wait      seconds to wait out an etcd outage

A password is only ever read from a file (a Kubernetes Secret mounted as one in a cluster): a
command line or a pod's args are visible to anyone who can list processes or read pod specs.
A parent process hands its settings to the processes it starts with ``to_env()``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.etcd.keys import run_prefix_of

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/kfp-elastic"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
# How long a master (its leadership request, its read of the run's state) and a worker (its
# commit of a step) wait out an etcd that cannot be reached (a restart, a leader election, a
# network partition) before they fail naming etcd. Longer than a restart of a member; short
# enough that a job whose etcd is gone for good fails instead of hanging.
DEFAULT_OUTAGE_WAIT_S = 60.0


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the flag or variable to fix."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    secure: bool = False

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``host:port``, with ``https://`` when the endpoint itself asks for TLS."""
        return f"https://{self}" if self.secure else str(self)


@dataclass(frozen=True)
class Setting:
    """One field of ``EtcdSettings``: the variable and the flag that set it."""

    name: str
    env: str
    flag: str
    help: str


SETTINGS = (
    Setting(
        "endpoints",
        "KFP_ELASTIC_ETCD_ENDPOINTS",
        "--etcd",
        "etcd as HOST:PORT[,HOST:PORT...] (https://HOST:PORT for TLS)",
    ),
    Setting("cacert", "KFP_ELASTIC_ETCD_CACERT", "--etcd-cacert", "CA file; turns TLS on"),
    Setting("cert", "KFP_ELASTIC_ETCD_CERT", "--etcd-cert", "client certificate (mutual TLS)"),
    Setting("key", "KFP_ELASTIC_ETCD_KEY", "--etcd-key", "client certificate's private key"),
    Setting("user", "KFP_ELASTIC_ETCD_USER", "--etcd-user", "etcd user (etcd auth enabled)"),
    Setting(
        "password_file",
        "KFP_ELASTIC_ETCD_PASSWORD_FILE",
        "--etcd-password-file",
        "file holding the etcd user's password (never pass a password itself)",
    ),
    Setting(
        "key_prefix",
        "KFP_ELASTIC_ETCD_KEY_PREFIX",
        "--key-prefix",
        f"every etcd key lives under it (default {DEFAULT_KEY_PREFIX})",
    ),
    Setting(
        "request_timeout",
        "KFP_ELASTIC_ETCD_REQUEST_TIMEOUT",
        "--etcd-request-timeout",
        f"seconds per etcd request (default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    ),
    Setting(
        "outage_wait",
        "KFP_ELASTIC_ETCD_OUTAGE_WAIT",
        "--etcd-outage-wait",
        "seconds a master or a worker waits out an unreachable etcd (a restart, an election) "
        f"before it fails (default {DEFAULT_OUTAGE_WAIT_S:g})",
    ),
)
BY_NAME = {setting.name: setting for setting in SETTINGS}
ENV_VARS = tuple(setting.env for setting in SETTINGS)
# Settings that name files: a process elsewhere (a pod) needs its own copies of them.
FILE_SETTINGS = ("cacert", "cert", "key", "password_file")


@dataclass(frozen=True)
class EtcdSettings:
    """Endpoints, TLS files, user + password, key prefix, request timeout and outage wait.

    ``password`` is the content of ``password_file`` (read once, when the settings are built);
    it never shows in ``repr`` and never leaves the process (``to_env`` hands on the file).
    ``origins`` says where each value came from, so that errors name what to fix.
    """

    endpoints: tuple[Endpoint, ...]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    password: str | None = field(default=None, repr=False)
    key_prefix: str = DEFAULT_KEY_PREFIX
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    outage_wait: float = DEFAULT_OUTAGE_WAIT_S
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def uses_tls(self) -> bool:
        return self.cacert is not None or any(endpoint.secure for endpoint in self.endpoints)

    @property
    def endpoint_text(self) -> str:
        """The endpoints as ``--rdzv-endpoint`` / ``KFP_ELASTIC_ETCD_ENDPOINTS`` take them."""
        return ",".join(endpoint.url for endpoint in self.endpoints)

    def run_prefix(self, run_id: str) -> str:
        return run_prefix_of(self.key_prefix, run_id)

    def origin(self, name: str) -> str:
        """How a user sets ``name``: the flag or variable it came from, else both."""
        if name in self.origins:
            return self.origins[name]
        setting = BY_NAME[name]
        return f"{setting.flag} ({setting.env})"

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the flag/variable of the first unusable setting."""
        if not self.endpoints:
            raise ConfigError(f"{self.origin('endpoints')} is empty: give etcd as HOST:PORT")
        for name in ("request_timeout", "outage_wait"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.origin(name)}={getattr(self, name)} must be > 0")
        if not self.key_prefix.startswith("/"):
            raise ConfigError(
                f"{self.origin('key_prefix')}={self.key_prefix!r} must start with '/'"
            )
        if (self.cert is None) != (self.key is None):
            raise ConfigError(
                f"{self.origin('cert')} and {self.origin('key')} (client TLS) go together: "
                "give both or neither"
            )
        if self.cert is not None and self.cacert is None:
            raise ConfigError(f"{self.origin('cert')} needs {self.origin('cacert')} too")
        if any(e.secure for e in self.endpoints) and self.cacert is None:
            raise ConfigError(f"an https:// endpoint needs {self.origin('cacert')}")
        if self.user is None and (self.password_file is not None or self.password is not None):
            raise ConfigError(f"{self.origin('password_file')} needs {self.origin('user')} too")
        if self.user is not None and self.password is None:
            raise ConfigError(
                f"{self.origin('user')} needs a password: give {self.origin('password_file')}"
            )
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{self.origin(name)}={path}: no such file")

    def to_env(self, *, files: bool = True) -> dict[str, str]:
        """The ``KFP_ELASTIC_ETCD_*`` variables that give a child process these settings.

        ``files=False`` leaves out the settings that name local files (a pod mounts its own).
        """
        if files and self.password is not None and self.password_file is None:
            raise ConfigError(
                "a password given in memory cannot be handed to another process: "
                f"use {self.origin('password_file')}"
            )
        values: dict[str, Any] = {
            "endpoints": self.endpoint_text,
            "cacert": self.cacert,
            "cert": self.cert,
            "key": self.key,
            "user": self.user,
            "password_file": self.password_file,
            "key_prefix": self.key_prefix,
            "request_timeout": f"{self.request_timeout:g}",
            "outage_wait": f"{self.outage_wait:g}",
        }
        return {
            BY_NAME[name].env: str(value)
            for name, value in values.items()
            if value is not None and (files or name not in FILE_SETTINGS)
        }

    @classmethod
    def for_endpoint(cls, endpoint: str, **values: Any) -> EtcdSettings:
        """Settings for ``endpoint`` and ``values`` (field names), checked; for tools and tests.

        A ``password_file`` given here is read like one from a flag.
        """
        raw = {name: value for name, value in values.items() if value is not None}
        raw["endpoints"] = endpoint
        return build({k: str(v) for k, v in raw.items()}, {k: k for k in raw})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdSettings:
        """The settings in the ``KFP_ELASTIC_ETCD_*`` variables (of this process by default)."""
        return from_sources({}, os.environ if env is None else env)


def parse_endpoints(text: str, origin: str = "--etcd") -> tuple[Endpoint, ...]:
    """``host[:port][,host[:port]...]``, each optionally ``http://`` or ``https://``."""
    if not text or not text.strip():
        raise ConfigError(
            f"{origin} is empty: give etcd as HOST:PORT[,HOST:PORT...] "
            "(start one locally with `kfp-elastic etcd`)"
        )
    endpoints = []
    for part in text.split(","):
        part = part.strip()
        match = _ENDPOINT_RE.match(part)
        if not match:
            raise ConfigError(f"{origin} entry {part!r} is not HOST[:PORT]")
        port_text = match.group("port")
        if port_text is None or port_text == "":
            port = DEFAULT_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ConfigError(f"{origin} entry {part!r}: port {port_text!r} is not 1-65535")
        host = match.group("host").strip("[]")
        endpoints.append(Endpoint(host, port, secure=match.group("scheme") == "https"))
    return tuple(endpoints)


_ENDPOINT_RE = re.compile(
    r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9a-fA-F:]+\]|[^:/\s]+)"
    r"(?::(?P<port>[^/]*))?/?$"
)


def from_sources(
    given: Mapping[str, str],
    env: Mapping[str, str],
    names: Mapping[str, str] | None = None,
) -> EtcdSettings:
    """Settings from explicit values (field name → text, e.g. flags), else the environment.

    ``names`` says how the caller's user gives each field explicitly (default: the flags, e.g.
    ``--rdzv-conf cacert`` for an agent); errors name that or the variable a value came from.
    """
    values: dict[str, str] = {}
    origins: dict[str, str] = {}
    for setting in SETTINGS:
        name = (names or {}).get(setting.name, setting.flag)
        if given.get(setting.name) not in (None, ""):
            values[setting.name] = given[setting.name]
            origins[setting.name] = name
        elif env.get(setting.env):
            values[setting.name] = env[setting.env]
            origins[setting.name] = setting.env
        else:
            origins[setting.name] = f"{name} ({setting.env})"
    return build(values, origins)


def build(values: Mapping[str, str], origins: Mapping[str, str]) -> EtcdSettings:
    """Typed, validated settings from text ``values`` (field name → text)."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown etcd settings {unknown}; known: {sorted(BY_NAME)}")
    probe = EtcdSettings(endpoints=(), origins=dict(origins))
    typed: dict[str, Any] = {
        name: text.strip() for name, text in values.items() if name != "endpoints"
    }
    for name in ("request_timeout", "outage_wait"):
        if name in typed:
            try:
                typed[name] = float(typed[name])
            except ValueError:
                raise ConfigError(
                    f"{probe.origin(name)}={values[name]!r} is not a number of seconds"
                ) from None
    if "password_file" in typed:
        typed["password"] = _read_password(typed["password_file"], probe.origin("password_file"))
    settings = EtcdSettings(
        endpoints=parse_endpoints(values.get("endpoints", ""), probe.origin("endpoints")),
        origins=dict(origins),
        **typed,
    )
    settings.validate()
    return settings


def _read_password(path: str, origin: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            # One trailing newline is the file's, not the password's (echo, kubectl, editors).
            password = handle.read().removesuffix("\n").removesuffix("\r")
    except OSError as error:
        raise ConfigError(f"{origin}={path}: cannot read the password: {error}") from None
    if not password:
        raise ConfigError(f"{origin}={path} is empty")
    return password


def add_arguments(parser: argparse.ArgumentParser, *, endpoints_help: str | None = None) -> None:
    """Add ``--etcd``, ``--etcd-cacert``, ... to ``parser``; each defaults to its variable."""
    group = parser.add_argument_group(
        "etcd connection (each flag defaults to its KFP_ELASTIC_ETCD_* variable)"
    )
    for setting in SETTINGS:
        text = endpoints_help if setting.name == "endpoints" and endpoints_help else setting.help
        group.add_argument(
            setting.flag,
            dest=_dest(setting),
            default=None,
            metavar="FILE" if setting.name in FILE_SETTINGS else None,
            help=f"{text} [env {setting.env}]",
        )


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EtcdSettings:
    """The settings given by ``add_arguments``' flags, else by the environment."""
    given = {s.name: getattr(args, _dest(s)) for s in SETTINGS if getattr(args, _dest(s), None)}
    return from_sources(given, os.environ if env is None else env)


def _dest(setting: Setting) -> str:
    return setting.flag.lstrip("-").replace("-", "_")
