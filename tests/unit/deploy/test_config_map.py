"""The kfp-elastic-config ConfigMap: every key is a setting the code reads, and with the
production overlay's values the master builds worker pods that get the etcd client Secret
(mounted where the ConfigMap's KFP_ELASTIC_ETCD_CACERT/_CERT/_KEY point) and every other value.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.job_spec import KUBERNETES_ENV_VARS, KubernetesSettings
from kfp_elastic.master.cli import build_parser, make_spec, split_entry
from kfp_elastic.master.pod_spec import build_pod
from kfp_elastic.master.pod_spec_checks import ETCD_TLS_MOUNT, TLS_SECRET_ENV
from kfp_elastic.master.wiring import worker_pod_template
from tests.helpers import one, render

TARGETS = ["base", "overlays/local-kind", "overlays/production"]
FILE_KEYS = ("KFP_ELASTIC_ETCD_CACERT", "KFP_ELASTIC_ETCD_CERT", "KFP_ELASTIC_ETCD_KEY")


def config(target: str) -> dict[str, str]:
    return one(render(target), "ConfigMap", "kfp-elastic-config")["data"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_key_is_a_setting_the_code_reads(target: str) -> None:
    data = config(target)
    read = set(etcd_settings.ENV_VARS) | set(KUBERNETES_ENV_VARS)
    assert set(data) <= read, f"keys nothing reads: {sorted(set(data) - read)}"
    # The Kubernetes keys with a value change what the master resolves (read, not just named).
    resolved = KubernetesSettings().resolved(data)
    for key, value in data.items():
        if key in KUBERNETES_ENV_VARS and value:
            assert resolved != KubernetesSettings().resolved({**data, key: value + "-x"}), key


def test_one_worker_image_name_everywhere() -> None:
    """The tag images/README.md builds, the ConfigMap's worker image, the master's default and
    the components' image agree: a kind user who loads that one image runs everything."""
    from kfp_elastic.components import BASE_IMAGE
    from kfp_elastic.job_spec import DEFAULT_WORKER_IMAGE

    assert config("base")["KFP_ELASTIC_WORKER_IMAGE"] == DEFAULT_WORKER_IMAGE == BASE_IMAGE
    readme = Path(__file__).parents[3] / "images" / "README.md"
    assert f"-t {DEFAULT_WORKER_IMAGE} ." in readme.read_text()


def test_production_values_reach_the_worker_pods(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = config("overlays/production")
    # The master (the training task) has the client Secret mounted at ETCD_TLS_MOUNT; here the
    # files live in tmp_path, since EtcdSettings checks that they exist.
    master_env = dict(data)
    for key in FILE_KEYS:
        local = tmp_path / Path(data[key]).name
        local.write_text("PEM")
        master_env[key] = str(local)
    for key, value in master_env.items():
        monkeypatch.setenv(key, value)
    own, entry = split_entry(["--run-id", "r-1", "--launcher", "kubernetes", "--", "train.py"])
    args = build_parser().parse_args(own)
    spec = make_spec(args, entry, etcd_settings.from_args(args, env=master_env))
    pod = build_pod(worker_pod_template(spec))

    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    secret_volumes = {
        v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (tls_volume,) = [n for n, s in secret_volumes.items() if s == data[TLS_SECRET_ENV]]
    assert mounts[tls_volume] == ETCD_TLS_MOUNT
    for key in FILE_KEYS:  # the pod's own copies, where the Secret is mounted in the pod
        assert env[key] == data[key] and data[key].startswith(ETCD_TLS_MOUNT + "/")
    assert env["KFP_ELASTIC_ETCD_ENDPOINTS"] == data["KFP_ELASTIC_ETCD_ENDPOINTS"]
    assert container["image"] == data["KFP_ELASTIC_WORKER_IMAGE"]
    assert pod["spec"]["priorityClassName"] == data["KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS"]
    other = build_pod(replace(worker_pod_template(spec), worker_index=1))  # min_workers=1
    assert (
        other["spec"]["priorityClassName"]
        == data["KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS"]
    )
    assert pod["spec"]["serviceAccountName"] == data["KFP_ELASTIC_WORKER_SERVICE_ACCOUNT"]
    assert not [a for a in container["args"] if "etcd-tls" in a or "cacert" in a]
