"""Connecting to etcd (several endpoints, TLS, user/password) with errors that say what to fix."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from pyetcd import exceptions as etcd_errors
from pyetcd.client import Endpoint as PyEtcdEndpoint
from pyetcd.client import MultiEndpointEtcd3Client

from .config import RendezvousConfig

log = logging.getLogger(__name__)

# A failed endpoint is tried again after this long (pyetcd's default of 300 s would make a
# restarted etcd unusable for five minutes).
ENDPOINT_RETRY_S = 0.5

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.NoServerAvailableError,
    grpc.RpcError,
)

T = TypeVar("T")


class EtcdConnectionError(ConnectionError):
    """etcd cannot be reached or refused us; the message says which endpoint and why."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise EtcdConnectionError(f"cannot read {what} file {path}: {error}") from error


def _credentials(config: RendezvousConfig) -> grpc.ChannelCredentials | None:
    if not config.uses_tls:
        return None
    assert config.cacert is not None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.cacert, "cacert"),
        private_key=_read(config.key, "key") if config.key else None,
        certificate_chain=_read(config.cert, "cert") if config.cert else None,
    )


def connect(config: RendezvousConfig) -> MultiEndpointEtcd3Client:
    """A client over all endpoints, checked to answer within ``request_timeout`` seconds."""
    credentials = _credentials(config)
    endpoints = [
        PyEtcdEndpoint(e.host, e.port, secure=credentials is not None, creds=credentials,
                       time_retry=ENDPOINT_RETRY_S)
        for e in config.endpoints
    ]
    where = ",".join(str(e) for e in config.endpoints)
    scheme = "TLS" if credentials else "plaintext"
    try:
        client = MultiEndpointEtcd3Client(
            endpoints=endpoints, timeout=config.request_timeout, user=config.user,
            password=config.password, failover=True,
        )
    except grpc.RpcError as error:
        raise EtcdConnectionError(_explain(error, where, scheme, config)) from error
    deadline = time.monotonic() + config.request_timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            client.status()
            return client
        except grpc.RpcError as error:
            last_error = error
            if error.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED):
                break
        except TRANSIENT_ERRORS as error:
            last_error = error
        time.sleep(0.1)
    client.close()
    raise EtcdConnectionError(_explain(last_error, where, scheme, config))


def _explain(
    error: BaseException | None, where: str, scheme: str, config: RendezvousConfig
) -> str:
    detail = error.details() if isinstance(error, grpc.RpcError) else repr(error)
    hints = []
    if isinstance(error, grpc.RpcError) and error.code() in (
        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        hints.append("check --rdzv-conf user/password")
    elif config.uses_tls:
        hints.append("check cacert/cert/key match the server and the endpoint uses TLS")
    else:
        hints.append("is etcd running there? (`python -m rendezvous.embedded_etcd` starts one)")
    return (
        f"cannot use etcd at {where} ({scheme}) within {config.request_timeout}s: {detail}; "
        + "; ".join(hints)
    )


def retry(call: Callable[[], T], timeout: float, what: str) -> T:
    """Run ``call``, retrying transient etcd errors until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return call()
        except TRANSIENT_ERRORS as error:
            if time.monotonic() + delay >= deadline:
                raise EtcdConnectionError(f"etcd unavailable while {what}: {error!r}") from error
            log.debug("etcd call failed, retrying what=%s error=%r", what, error)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
