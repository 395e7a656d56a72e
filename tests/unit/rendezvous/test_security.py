"""TLS (server and client certificates) and etcd user/password auth, against real etcd servers.

Every test starts its own etcd (``EmbeddedEtcd`` stops it in teardown, also on failure) and
shuts down every handler it made. Negative cases use a short ``request_timeout`` and assert an
upper bound on how long the failure takes: a bad setting must fail, never hang.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.etcd.pki import TestPki, TlsFiles, generate_test_pki
from kfp_elastic.rendezvous.handler import ElasticEtcdRendezvousHandler, create_handler

FAIL_WITHIN_S = 10.0
ROOT_PASSWORD = "root-secret"
USER, PASSWORD = "trainer", "trainer-secret"
KEY_PREFIX = "/kfp-elastic"

HandlerFactory = Callable[..., ElasticEtcdRendezvousHandler]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return generate_test_pki(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def _server(
    tls: TlsFiles | None, auth: bool = False, extra_args: list[str] | None = None
) -> Iterator[EmbeddedEtcd]:
    etcd = EmbeddedEtcd(tls=tls, extra_args=extra_args)
    try:
        etcd.start()
        if auth:
            etcd.enable_auth(ROOT_PASSWORD)
            # A user who may only touch the rendezvous prefix: the backend needs no more.
            etcd.add_user(USER, PASSWORD, key_prefix=f"{KEY_PREFIX}/")
        yield etcd
    finally:
        etcd.stop()
        assert etcd._process is None or etcd._process.poll() is not None, "etcd left running"


@pytest.fixture
def mtls_etcd(pki: TestPki) -> Iterator[EmbeddedEtcd]:
    """https, client certificates required."""
    with _server(pki.server) as etcd:
        yield etcd


def _server_only_tls(pki: TestPki) -> TlsFiles:
    return TlsFiles(pki.server.ca, pki.server.cert, pki.server.key, client_cert_auth=False)


@pytest.fixture
def make_handler(tmp_path: Path) -> Iterator[HandlerFactory]:
    """``make_handler(endpoint, **conf)``; every handler made is left in teardown. A
    ``password=`` is written to a file and passed as ``password_file`` (never on a command
    line)."""
    made: list[ElasticEtcdRendezvousHandler] = []

    def make(endpoint: str, **conf: object) -> ElasticEtcdRendezvousHandler:
        if "password" in conf:
            password_file = tmp_path / f"password-{uuid.uuid4().hex[:6]}"
            password_file.write_text(f"{conf.pop('password')}\n")
            conf["password_file"] = str(password_file)
        conf.setdefault("peer_probe", "false")
        conf.setdefault("last_call_timeout", "0.5")
        params = RendezvousParameters(
            "elastic-etcd",
            endpoint,
            f"sec-{uuid.uuid4().hex[:10]}",
            1,
            1,
            local_addr="127.0.0.1",
            **{k: str(v) for k, v in conf.items()},
        )
        handler = create_handler(params)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.leave("test teardown")


def _client_tls(pki: TestPki) -> dict[str, str]:
    return {"cacert": str(pki.ca), "cert": str(pki.client_cert), "key": str(pki.client_key)}


def _single_node_round(handler: ElasticEtcdRendezvousHandler) -> None:
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert handler.shutdown()


def _fails_fast(
    make: Callable[[], object], expected: type[BaseException] = Exception
) -> BaseException:
    started = time.monotonic()
    with pytest.raises(expected) as caught:
        make()
    elapsed = time.monotonic() - started
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f}s to fail: {caught.value}"
    return caught.value


# --------------------------------------------------------------------------------------- TLS


def test_mutual_tls_with_https_endpoint(
    mtls_etcd: EmbeddedEtcd, pki: TestPki, make_handler: HandlerFactory
) -> None:
    assert mtls_etcd.client_url.startswith("https://")
    handler = make_handler(f"https://{mtls_etcd.endpoint}", **_client_tls(pki))
    _single_node_round(handler)


def test_cacert_alone_turns_on_tls_for_a_plain_endpoint(
    mtls_etcd: EmbeddedEtcd, pki: TestPki, make_handler: HandlerFactory
) -> None:
    handler = make_handler(mtls_etcd.endpoint, **_client_tls(pki))
    _single_node_round(handler)


def test_server_only_tls_needs_no_client_certificate(
    pki: TestPki, make_handler: HandlerFactory
) -> None:
    with _server(_server_only_tls(pki)) as etcd:
        handler = make_handler(f"https://{etcd.endpoint}", cacert=str(pki.ca))
        _single_node_round(handler)


def test_wrong_ca_fails_fast_naming_endpoint_and_tls(
    mtls_etcd: EmbeddedEtcd, pki: TestPki, make_handler: HandlerFactory
) -> None:
    conf = {**_client_tls(pki), "cacert": str(pki.other_ca), "request_timeout": "1"}
    error = _fails_fast(lambda: make_handler(f"https://{mtls_etcd.endpoint}", **conf))
    assert mtls_etcd.endpoint in str(error)
    assert "TLS" in str(error)


@pytest.mark.parametrize("client", ["other-ca-certificate", "no-certificate"])
def test_server_refuses_client_without_a_certificate_it_trusts(
    mtls_etcd: EmbeddedEtcd, pki: TestPki, make_handler: HandlerFactory, client: str
) -> None:
    conf = {"cacert": str(pki.ca), "request_timeout": "1"}
    if client == "other-ca-certificate":
        conf.update(cert=str(pki.other_client_cert), key=str(pki.other_client_key))
    error = _fails_fast(lambda: make_handler(mtls_etcd.endpoint, **conf))
    assert mtls_etcd.endpoint in str(error)
    assert "TLS" in str(error)


def test_plaintext_client_against_tls_server_fails_fast(
    mtls_etcd: EmbeddedEtcd, make_handler: HandlerFactory
) -> None:
    error = _fails_fast(lambda: make_handler(mtls_etcd.endpoint, request_timeout="1"))
    assert mtls_etcd.endpoint in str(error)


def test_missing_cacert_file_is_a_value_error_at_once(
    tmp_path: Path, make_handler: HandlerFactory
) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="cacert") as caught:
        make_handler("https://127.0.0.1:1", cacert=str(tmp_path / "missing-ca.pem"))
    assert time.monotonic() - started < 2.0
    assert "missing-ca.pem" in str(caught.value)


def test_cert_without_key_is_a_value_error(pki: TestPki, make_handler: HandlerFactory) -> None:
    with pytest.raises(ValueError, match="key"):
        make_handler("127.0.0.1:1", cacert=str(pki.ca), cert=str(pki.client_cert))


def test_https_endpoint_without_cacert_is_a_value_error(make_handler: HandlerFactory) -> None:
    with pytest.raises(ValueError, match="cacert"):
        make_handler("https://127.0.0.1:1")


# -------------------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("user", "transport"), [(USER, "server-tls"), (USER, "mutual-tls"), ("root", "server-tls")]
)
def test_auth_with_correct_password(
    pki: TestPki, make_handler: HandlerFactory, transport: str, user: str
) -> None:
    tls = pki.server if transport == "mutual-tls" else _server_only_tls(pki)
    conf = _client_tls(pki) if transport == "mutual-tls" else {"cacert": str(pki.ca)}
    password = ROOT_PASSWORD if user == "root" else PASSWORD
    with _server(tls, auth=True) as etcd:
        handler = make_handler(etcd.endpoint, user=user, password=password, **conf)
        _single_node_round(handler)


def test_auth_wrong_password_fails_fast_naming_user_password(
    pki: TestPki, make_handler: HandlerFactory
) -> None:
    with _server(_server_only_tls(pki), auth=True) as etcd:
        error = _fails_fast(
            lambda: make_handler(
                etcd.endpoint,
                cacert=str(pki.ca),
                user=USER,
                password="wrong",
                request_timeout="1",
            )
        )
        assert "--rdzv-conf user and --rdzv-conf password_file" in str(error)
        assert etcd.endpoint in str(error)


def test_auth_missing_credentials_fails_fast(pki: TestPki, make_handler: HandlerFactory) -> None:
    with _server(_server_only_tls(pki), auth=True) as etcd:
        error = _fails_fast(
            lambda: make_handler(etcd.endpoint, cacert=str(pki.ca), request_timeout="1")
        )
        # etcd's own words: "etcdserver: user name is empty".
        assert "user" in str(error).lower()


def test_user_without_permission_on_the_prefix_fails_fast(
    pki: TestPki, make_handler: HandlerFactory
) -> None:
    with _server(_server_only_tls(pki), auth=True) as etcd:
        etcd.add_user("outsider", "outsider-secret")  # no role: may read and write nothing
        error = _fails_fast(
            lambda: make_handler(
                etcd.endpoint,
                cacert=str(pki.ca),
                user="outsider",
                password="outsider-secret",
                request_timeout="1",
            )
        )
        assert "permission denied" in str(error)


def test_client_certificate_common_name_is_the_user_without_tokens(
    pki: TestPki, make_handler: HandlerFactory
) -> None:
    # With --client-cert-auth and auth on, etcd takes the user from the certificate's CN when a
    # request carries no token: no password, and nothing that expires (the token TTL is 1 s).
    with _server(pki.server, auth=True, extra_args=["--auth-token-ttl=1"]) as etcd:
        etcd.add_user("kfp-elastic-client", "unused-password", key_prefix=f"{KEY_PREFIX}/")
        handler = make_handler(etcd.endpoint, **_client_tls(pki))
        assert handler.next_rendezvous().world_size == 1
        time.sleep(2)
        handler.set_closed()
        assert handler.shutdown()


def test_user_and_password_must_come_together(make_handler: HandlerFactory) -> None:
    with pytest.raises(ValueError, match="user needs a password: give --rdzv-conf password_file"):
        make_handler("127.0.0.1:1", user=USER)


def test_a_password_on_the_command_line_is_refused() -> None:
    params = RendezvousParameters("elastic-etcd", "127.0.0.1:1", "r", 1, 1, user=USER, password="x")
    with pytest.raises(ValueError, match="password is not accepted.*password_file"):
        create_handler(params)


def test_auth_over_plaintext(make_handler: HandlerFactory) -> None:
    with _server(None, auth=True) as etcd:
        handler = make_handler(etcd.endpoint, user=USER, password=PASSWORD, request_timeout="1")
        _single_node_round(handler)


def test_auth_survives_token_expiry(pki: TestPki, make_handler: HandlerFactory) -> None:
    # Lease keep-alives do not renew a simple token; only KV requests do (default TTL 300 s).
    with _server(_server_only_tls(pki), auth=True, extra_args=["--auth-token-ttl=1"]) as etcd:
        handler = make_handler(etcd.endpoint, cacert=str(pki.ca), user=USER, password=PASSWORD)
        info = handler.next_rendezvous()
        assert info.world_size == 1
        time.sleep(2.5)  # a quiet training phase, longer than the token TTL
        handler.set_closed()


def test_etcdctl_gets_passwords_through_env_and_stdin_not_argv(tmp_path: Path) -> None:
    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "data"))
    etcd.auth = ("root", "s3cret-root")
    command, env = etcd.etcdctl_command("user", "add", "trainer", "--interactive=false")
    assert not any("s3cret" in part for part in command)
    assert (env["ETCDCTL_USER"], env["ETCDCTL_PASSWORD"]) == ("root", "s3cret-root")
