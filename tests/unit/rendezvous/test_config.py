"""Parsing --rdzv-endpoint / --rdzv-conf: pure, and every bad value named in the error."""

from pathlib import Path

import pytest

from kfp_elastic.contract.rendezvous_config import (
    ConfigError,
    Endpoint,
    RendezvousConfig,
    parse_endpoints,
)


def config(conf: dict, endpoint: str = "127.0.0.1:2379", nnodes: tuple = (1, 2), env=None):
    return RendezvousConfig.from_params(
        endpoint, "job", nnodes[0], nnodes[1], None, conf, env={} if env is None else env
    )


def test_several_endpoints_with_default_port_and_schemes() -> None:
    assert parse_endpoints("a:1, b ,https://c:3,[::1]:4") == (
        Endpoint("a", 1),
        Endpoint("b", 2379),
        Endpoint("c", 3, secure=True),
        Endpoint("::1", 4),
    )


@pytest.mark.parametrize("text", ["", "host:port", "a:99999", "a:1/x/y", "a b:1", "a:0"])
def test_malformed_endpoint_is_rejected(text: str) -> None:
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        config({}, endpoint=text)


def test_defaults_and_torch_names() -> None:
    cfg = config({"timeout": "900"})
    assert cfg.join_timeout == 900.0  # torchrun's legacy --rdzv-timeout arrives as 'timeout'
    assert cfg.last_call_timeout == 1.0 and cfg.close_timeout == 30.0 and cfg.lease_ttl == 5.0
    cfg = config(
        {
            "timeout": "900",
            "join_timeout": "12",
            "last_call_timeout": "0.5",
            "peer_probe": "false",
            "key_prefix": "/x",
        }
    )
    assert (cfg.join_timeout, cfg.last_call_timeout, cfg.peer_probe) == (12.0, 0.5, False)
    assert cfg.run_prefix == "/x/job"


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"joint_timeout": "1"}, "unknown --rdzv-conf key 'joint_timeout'"),
        ({"is_host": "1"}, "c10d/static setting"),
        ({"lease_ttl": "fast"}, "lease_ttl='fast' is not a number"),
        ({"lease_ttl": "1"}, "below etcd's minimum"),
        ({"join_timeout": "-1"}, "join_timeout=-1.0 must be > 0"),
        ({"peer_probe": "maybe"}, "not a boolean"),
        ({"probe_fanout": "x"}, "not an integer"),
        ({"key_prefix": "noslash"}, "must start with '/'"),
        ({"user": "root"}, "--rdzv-conf user needs a password: give --rdzv-conf password_file"),
        ({"password": "secret"}, "password is not accepted: .* use password_file=FILE"),
        ({"password_file": "/nonexistent/pw"}, "password_file=/nonexistent/pw: cannot read"),
        ({"cert": "/c.pem"}, "--rdzv-conf cert and --rdzv-conf key .* go together"),
        ({"request_timeout": "soon"}, "request_timeout='soon' is not a number"),
        ({"cacert": "/nonexistent/ca.pem"}, "cacert=/nonexistent/ca.pem: no such file"),
    ],
)
def test_bad_conf_values_name_the_key(conf: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        config(conf)


def test_min_greater_than_max_is_rejected() -> None:
    with pytest.raises(ConfigError, match="need 1 <= MIN <= MAX"):
        config({}, nnodes=(3, 2))


def test_https_endpoint_requires_cacert() -> None:
    with pytest.raises(ConfigError, match="needs --rdzv-conf cacert"):
        config({}, endpoint="https://127.0.0.1:2379")


def test_etcd_settings_not_in_rdzv_conf_come_from_the_environment(tmp_path) -> None:
    """A master hands its etcd settings to agents through env alone; --rdzv-conf wins."""
    password = tmp_path / "pw"
    password.write_text("s3cret\n")
    env = {
        "KFP_ELASTIC_ETCD_USER": "trainer",
        "KFP_ELASTIC_ETCD_PASSWORD_FILE": str(password),
        "KFP_ELASTIC_ETCD_KEY_PREFIX": "/from-env",
        "KFP_ELASTIC_ETCD_REQUEST_TIMEOUT": "7",
    }
    cfg = config({"key_prefix": "/from-conf"}, env=env)
    assert (cfg.etcd.user, cfg.etcd.password) == ("trainer", "s3cret")
    assert cfg.key_prefix == "/from-conf" and cfg.request_timeout == 7.0
    assert "s3cret" not in repr(cfg)
    fallback = config({}, endpoint="", env={"KFP_ELASTIC_ETCD_ENDPOINTS": "e:1"})
    assert fallback.endpoints == (Endpoint("e", 1),)


def test_store_timeout_is_a_setting_in_seconds() -> None:
    assert config({}).store_timeout == 300.0
    assert config({"store_timeout": "12.5"}).store_timeout == 12.5
    with pytest.raises(ConfigError, match="store_timeout"):
        config({"store_timeout": "0"})


def test_readme_documents_every_rdzv_conf_key() -> None:
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    table = readme[readme.index("### `--rdzv-conf` keys") :]
    missing = [name for name in RendezvousConfig.setting_names() if f"`{name}`" not in table]
    assert missing == []


def test_probe_connect_timeout_is_a_setting_in_seconds() -> None:
    assert config({}).probe_connect_timeout == 1.0
    assert config({"probe_connect_timeout": "2.5"}).probe_connect_timeout == 2.5
    with pytest.raises(ConfigError, match="probe_connect_timeout"):
        config({"probe_connect_timeout": "0"})
    with pytest.raises(ConfigError, match="not a number of seconds"):
        config({"probe_connect_timeout": "soon"})
