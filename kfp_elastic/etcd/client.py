"""Connecting to etcd (several endpoints, TLS, user/password) with errors that say what to fix."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_errors
from pyetcd.client import Endpoint as PyEtcdEndpoint
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.settings import EtcdSettings

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

# Answers that retrying cannot fix: bad or missing credentials, missing permissions.
_FATAL_CODES = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
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


def _credentials(settings: EtcdSettings) -> grpc.ChannelCredentials | None:
    if not settings.uses_tls:
        return None
    assert settings.cacert is not None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.cacert, settings.origin("cacert")),
        private_key=_read(settings.key, settings.origin("key")) if settings.key else None,
        certificate_chain=_read(settings.cert, settings.origin("cert")) if settings.cert else None,
    )


def connect(settings: EtcdSettings) -> MultiEndpointEtcd3Client:
    """A client over all endpoints, checked to answer within ``request_timeout`` seconds."""
    config = settings
    credentials = _credentials(config)
    endpoints = [
        PyEtcdEndpoint(
            e.host,
            e.port,
            secure=credentials is not None,
            creds=credentials,
            time_retry=ENDPOINT_RETRY_S,
        )
        for e in config.endpoints
    ]
    where = ",".join(str(e) for e in config.endpoints)
    scheme = "TLS" if credentials else "plaintext"
    try:
        client = MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=config.request_timeout,
            user=config.user,
            password=config.password,
            failover=True,
        )
    except grpc.RpcError as error:
        raise EtcdConnectionError(_explain(error, where, scheme, config)) from error
    if config.user is not None and config.password is not None:
        TokenRefresher.install(client, config.user, config.password)
    deadline = time.monotonic() + config.request_timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            # A read under our prefix: etcd answers, and our credentials may use the prefix
            # (Status would pass without credentials when etcd's auth is on).
            client.get(config.key_prefix.rstrip("/") + "/")
            return client
        except grpc.RpcError as error:
            last_error = error
            if error.code() in _FATAL_CODES:
                break
        except TRANSIENT_ERRORS as error:
            # Keep the error that says why (e.g. a TLS handshake), not "no server available".
            if last_error is None or _rpc_cause(error) is not None:
                last_error = error
        time.sleep(0.1)
    client.close()
    raise EtcdConnectionError(_explain(last_error, where, scheme, config))


def _rpc_cause(error: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``error`` (pyetcd raises its own exceptions from inside one)."""
    while error is not None and not isinstance(error, grpc.RpcError):
        error = error.__cause__ or error.__context__
    return error


def _explain(error: BaseException | None, where: str, scheme: str, config: EtcdSettings) -> str:
    rpc = _rpc_cause(error)
    detail = rpc.details() if rpc is not None else repr(error)
    code = rpc.code() if rpc is not None else None
    hints = []
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in (detail or ""):
        hints.append(
            f"etcd has auth enabled: set {config.origin('user')} and "
            f"{config.origin('password_file')}"
        )
    elif code == grpc.StatusCode.PERMISSION_DENIED:
        hints.append(
            f"user {config.user} needs a role with readwrite on prefix "
            f"{config.key_prefix.rstrip('/')}/"
        )
    elif code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        hints.append(f"check {config.origin('user')} and {config.origin('password_file')}")
    elif config.uses_tls:
        hints.append(
            f"check {config.origin('cacert')}/{config.origin('cert')}/{config.origin('key')} "
            "match the server and the endpoint uses TLS"
        )
    else:
        hints.append("is etcd running there? (`kfp-elastic etcd` starts one)")
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


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class TokenRefresher(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Keeps a pyetcd client's auth token valid.

    pyetcd logs in once, in the client's constructor. etcd drops a simple token after
    ``--auth-token-ttl`` (300 s) without a KV request (lease keep-alives do not count) and on
    restart; then every request fails with "invalid auth token". This interceptor puts the
    current token on every call and, when etcd refuses it, logs in again and retries the
    (unary) call once. It also replaces pyetcd's call credentials, which gRPC refuses to send
    over plaintext channels ("insufficient security level").
    """

    _AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
    _STALE = (
        (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token"),
        (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old"),
    )

    def __init__(self, client: MultiEndpointEtcd3Client, user: str, password: str) -> None:
        self._client = client
        self._user = user
        self._password = password
        self._lock = threading.Lock()
        self.token: str | None = dict(client.metadata or ()).get("token")
        client.call_credentials = None

    @classmethod
    def install(cls, client: MultiEndpointEtcd3Client, user: str, password: str) -> None:
        refresher = cls(client, user, password)
        for endpoint in client.endpoints.values():
            endpoint.channel = grpc.intercept_channel(endpoint.channel, refresher)
        client._clear_old_stubs()  # stubs were bound to the plain channels

    def _reauthenticate(self, stale: str | None) -> None:
        with self._lock:
            if self.token != stale:
                return  # another thread already logged in again
            reply = self._client.authstub.Authenticate(
                etcdrpc.AuthenticateRequest(name=self._user, password=self._password),
                self._client.timeout,
            )
            self.token = reply.token
            self._client.metadata = (("token", reply.token),)
            watcher = self._client._stubs.get("watcher")
            if watcher is not None:  # its next stream logs in with the new token
                watcher._metadata = self._client.metadata
                watcher._call_credentials = None
            log.info("etcd auth token renewed user=%s", self._user)

    def _details(self, details: grpc.ClientCallDetails) -> tuple[_CallDetails, str | None]:
        token = self.token
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != "token"]
        if token and details.method != self._AUTHENTICATE:
            metadata.append(("token", token))
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        ), token

    def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        details, token = self._details(client_call_details)
        call = continuation(details, request)
        if details.method != self._AUTHENTICATE and any(
            call.code() == code and text in (call.details() or "") for code, text in self._STALE
        ):
            self._reauthenticate(token)
            call = continuation(self._details(client_call_details)[0], request)
        return call

    def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details)[0], request)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details)[0], request_iterator)
