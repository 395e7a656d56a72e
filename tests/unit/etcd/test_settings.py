"""EtcdSettings: the environment, the flags that mirror it, the password file, errors that name
what to fix, and the hand-over to child processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.settings import ConfigError, Endpoint, EtcdSettings
from tests.conftest import SecureEtcd


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name in ("ca.pem", "client.pem", "client-key.pem"):
        (tmp_path / name).write_text("PEM")
        paths[name] = str(tmp_path / name)
    (tmp_path / "password").write_text("s3cret\n")
    paths["password"] = str(tmp_path / "password")
    return paths


def full_env(files: dict[str, str]) -> dict[str, str]:
    return {
        "KFP_ELASTIC_ETCD_ENDPOINTS": "https://e1:2379,e2",
        "KFP_ELASTIC_ETCD_CACERT": files["ca.pem"],
        "KFP_ELASTIC_ETCD_CERT": files["client.pem"],
        "KFP_ELASTIC_ETCD_KEY": files["client-key.pem"],
        "KFP_ELASTIC_ETCD_USER": "trainer",
        "KFP_ELASTIC_ETCD_PASSWORD_FILE": files["password"],
        "KFP_ELASTIC_ETCD_KEY_PREFIX": "/team-a",
        "KFP_ELASTIC_ETCD_REQUEST_TIMEOUT": "7.5",
        "KFP_ELASTIC_ETCD_OUTAGE_WAIT": "90",
    }


def parse(argv: list[str], env: dict[str, str]) -> EtcdSettings:
    parser = argparse.ArgumentParser()
    etcd_settings.add_arguments(parser)
    return etcd_settings.from_args(parser.parse_args(argv), env)


def test_every_documented_variable_is_read(files: dict[str, str]) -> None:
    settings = EtcdSettings.from_env(full_env(files))
    assert settings.endpoints == (Endpoint("e1", 2379, secure=True), Endpoint("e2", 2379))
    assert (settings.cacert, settings.cert, settings.key) == (
        files["ca.pem"],
        files["client.pem"],
        files["client-key.pem"],
    )
    assert (settings.user, settings.password) == ("trainer", "s3cret")  # newline is the file's
    assert settings.key_prefix == "/team-a" and settings.request_timeout == 7.5
    assert settings.outage_wait == 90.0
    assert settings.uses_tls and settings.run_prefix("job") == "/team-a/job"


def test_flags_mirror_the_variables_and_win(files: dict[str, str], tmp_path: Path) -> None:
    other = tmp_path / "other-password"
    other.write_text("other")
    settings = parse(
        ["--etcd", "f:1", "--etcd-password-file", str(other), "--key-prefix", "/flags"],
        full_env(files),
    )
    assert settings.endpoints == (Endpoint("f", 1),)
    assert settings.password == "other" and settings.key_prefix == "/flags"
    assert settings.cacert == files["ca.pem"]  # not given as a flag: from the environment
    assert parse(["--etcd", "g:2"], {}).uses_tls is False


def test_the_password_never_shows_in_repr_or_env(files: dict[str, str]) -> None:
    settings = EtcdSettings.from_env(full_env(files))
    assert "s3cret" not in repr(settings)
    env = settings.to_env()
    assert "s3cret" not in str(env)
    assert env["KFP_ELASTIC_ETCD_PASSWORD_FILE"] == files["password"]


def test_to_env_hands_the_same_settings_to_a_child(files: dict[str, str]) -> None:
    settings = EtcdSettings.from_env(full_env(files))
    assert EtcdSettings.from_env(settings.to_env()) == settings
    assert set(settings.to_env()) == set(etcd_settings.ENV_VARS)
    pod = settings.to_env(files=False)  # a pod mounts its own files
    assert set(pod) == {
        "KFP_ELASTIC_ETCD_ENDPOINTS",
        "KFP_ELASTIC_ETCD_USER",
        "KFP_ELASTIC_ETCD_KEY_PREFIX",
        "KFP_ELASTIC_ETCD_REQUEST_TIMEOUT",
        "KFP_ELASTIC_ETCD_OUTAGE_WAIT",
    }
    assert pod["KFP_ELASTIC_ETCD_ENDPOINTS"] == "https://e1:2379,e2:2379"


def test_a_password_in_memory_cannot_be_handed_on() -> None:
    settings = EtcdSettings(endpoints=(Endpoint("e", 1),), user="u", password="p")
    with pytest.raises(ConfigError, match="in memory .* use --etcd-password-file"):
        settings.to_env()


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, r"--etcd \(KFP_ELASTIC_ETCD_ENDPOINTS\) is empty"),
        (["--etcd", "e:99999"], {}, "--etcd entry 'e:99999': port"),
        ([], {"KFP_ELASTIC_ETCD_ENDPOINTS": "e:x"}, "KFP_ELASTIC_ETCD_ENDPOINTS entry 'e:x'"),
        (["--etcd", "https://e:1"], {}, r"https:// endpoint needs --etcd-cacert \(KFP_"),
        (["--etcd", "e", "--etcd-cacert", "/no/ca.pem"], {}, "--etcd-cacert=/no/ca.pem: no such"),
        (["--etcd", "e", "--etcd-user", "u"], {}, "--etcd-user needs a password: give --etcd-pass"),
        (
            ["--etcd", "e"],
            {"KFP_ELASTIC_ETCD_USER": "u", "KFP_ELASTIC_ETCD_PASSWORD_FILE": "/no/pw"},
            "KFP_ELASTIC_ETCD_PASSWORD_FILE=/no/pw: cannot read the password",
        ),
        (["--etcd", "e", "--etcd-password-file", "PW"], {}, "--etcd-password-file needs --etcd-u"),
        (["--etcd", "e", "--key-prefix", "x"], {}, "--key-prefix='x' must start with '/'"),
        (["--etcd", "e", "--etcd-request-timeout", "0"], {}, "--etcd-request-timeout=0.0 must"),
        (
            ["--etcd", "e"],
            {"KFP_ELASTIC_ETCD_REQUEST_TIMEOUT": "soon"},
            "KFP_ELASTIC_ETCD_REQUEST_TIMEOUT='soon' is not a number",
        ),
        (["--etcd", "e", "--etcd-outage-wait", "-1"], {}, "--etcd-outage-wait=-1.0 must be > 0"),
        (
            ["--etcd", "e"],
            {"KFP_ELASTIC_ETCD_OUTAGE_WAIT": "a minute"},
            "KFP_ELASTIC_ETCD_OUTAGE_WAIT='a minute' is not a number",
        ),
        (["--etcd", "e", "--etcd-cert", "CA"], {}, "--etcd-cert and --etcd-key .* go together"),
    ],
)
def test_errors_name_the_flag_or_variable(
    argv: list[str], env: dict[str, str], message: str, files: dict[str, str]
) -> None:
    argv = [files["password"] if a == "PW" else files["ca.pem"] if a == "CA" else a for a in argv]
    with pytest.raises(ConfigError, match=message):
        parse(argv, env)


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        EtcdSettings.for_endpoint("e", user="u", password_file=str(tmp_path / "pw"))


def test_settings_reach_a_secured_etcd(secure_etcd: SecureEtcd) -> None:
    client = connect(EtcdSettings.from_env(secure_etcd.settings.to_env()))
    try:
        client.put("/kfp-elastic/settings-test", "ok")
        assert client.get("/kfp-elastic/settings-test")[0] == b"ok"
    finally:
        client.close()
