"""Worker pod manifests: pure (no cluster, no network); every field lands, bad input is named."""

from __future__ import annotations

import copy
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from kfp_elastic.master.pod_spec import (
    ATTEMPT_LABEL,
    INDEX_LABEL,
    JOB_LABEL,
    KUEUE_PRIORITY_CLASS_LABEL,
    KUEUE_QUEUE_LABEL,
    RUN_ID_LABEL,
    WorkerPodSpec,
    build_pod,
    parse_quantity,
    run_selector,
    selector,
)

BASE = WorkerPodSpec(
    job_name="mnist",
    image="kfp-elastic-worker:0.1.0",
    entrypoint="train.py",
    rdzv_endpoint="kfp-elastic-etcd-0.kfp-elastic-etcd-headless:2379",
    min_nodes=2,
    max_nodes=4,
)

FULL = WorkerPodSpec(
    job_name="resnet",
    run_id="resnet-run.7",
    worker_index=3,
    attempt=2,
    namespace="kfp-elastic",
    image="registry.example/worker@sha256:" + "a" * 64,
    entrypoint="trainer.main",
    module=True,
    entrypoint_args=("--epochs", "3", "--snapshot", "/snapshots/resnet"),
    rdzv_endpoint="$(KFP_ELASTIC_ETCD_ENDPOINTS)",
    min_nodes=1,
    max_nodes=8,
    nproc_per_node="gpu",
    rdzv_conf={"join_timeout": "120", "lease_ttl": "10"},
    max_restarts=5,
    torchrun_args=("--monitor-interval=1",),
    command=("python", "-m", "torch.distributed.run"),
    cpu="3500m",
    cpu_limit=8,
    memory="24Gi",
    memory_limit="32Gi",
    gpu=2,
    guaranteed_priority_class="team-guaranteed",
    opportunistic_priority_class="team-opportunistic",
    service_account="kfp-elastic-worker",
    tolerations=(
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {
            "key": "spot",
            "operator": "Equal",
            "value": "true",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        },
    ),
    node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
    affinity={
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {JOB_LABEL: "resnet"}},
                    },
                }
            ]
        }
    },
    labels={"team": "vision"},
    annotations={
        "example.com/owner": "alice",
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "true",
    },
    env={"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "KFP_ELASTIC_ETCD_USER": "trainer"},
    env_from_config_maps=("kfp-elastic-config",),
    volumes=({"name": "snapshots", "persistentVolumeClaim": {"claimName": "resnet-snapshots"}},),
    volume_mounts=({"name": "snapshots", "mountPath": "/snapshots"},),
    etcd_tls_secret="kfp-elastic-etcd-client-tls",
    etcd_password_secret="kfp-elastic-etcd-password",
    shm_size="2Gi",
    termination_grace_period_s=90,
    image_pull_policy="IfNotPresent",
    image_pull_secrets=("regcred",),
    run_as_user=2000,
)


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    return only


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod)["env"]}


def test_defaults_make_a_preemptible_never_restarting_worker() -> None:
    pod = build_pod(BASE)
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    assert pod["metadata"]["name"] == "mnist-worker-0-0"
    assert "namespace" not in pod["metadata"] and "ownerReferences" not in pod["metadata"]
    labels = pod["metadata"]["labels"]
    assert labels[JOB_LABEL] == "mnist" and labels[RUN_ID_LABEL] == "mnist"  # run id = job
    assert labels[INDEX_LABEL] == "0" and labels[ATTEMPT_LABEL] == "0"
    assert labels["app.kubernetes.io/part-of"] == "kfp-elastic"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    # manifests/base/priorityclasses.yaml; worker 0 of min_nodes=2 is guaranteed
    assert spec["priorityClassName"] == "kfp-elastic-worker-guaranteed"
    assert spec["serviceAccountName"] == "kfp-elastic-worker"  # manifests/base/rbac.yaml
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] == 30
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 1000  # the user of images/worker
    assert "volumes" not in spec and "nodeSelector" not in spec
    # A lost node's worker is evicted (and replaced) after 10 s, not Kubernetes' 300 s.
    assert spec["tolerations"] == [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 10}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    c = container(pod)
    assert c["command"] == ["kfp-elastic", "agent"] and "resources" in c and c["resources"] == {}
    assert c["args"] == [
        "--nnodes=2:4",
        "--nproc-per-node=1",
        "--rdzv-backend=elastic-etcd",
        "--rdzv-endpoint=kfp-elastic-etcd-0.kfp-elastic-etcd-headless:2379",
        "--rdzv-id=mnist",
        "--max-restarts=3",
        "--local-addr=$(POD_IP)",
        "train.py",
    ]
    env = env_of(pod)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KFP_ELASTIC_WORKER_INDEX"] == "0" and env["KFP_ELASTIC_RUN_ID"] == "mnist"


NOT_READY, UNREACHABLE = "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"


def node_loss(pod: dict[str, Any]) -> dict[str, Any]:
    """Key -> tolerationSeconds of the pod's tolerations for the node-loss taints."""
    return {
        t.get("key", ""): t.get("tolerationSeconds")
        for t in pod["spec"].get("tolerations") or []
        if t.get("key", "") in (NOT_READY, UNREACHABLE, "")
    }


def test_node_loss_tolerations_are_a_setting_and_the_users_own_win() -> None:
    assert node_loss(build_pod(BASE)) == {NOT_READY: 10, UNREACHABLE: 10}
    assert node_loss(build_pod(replace(BASE, node_loss_toleration_s=0))) == {
        NOT_READY: 0,
        UNREACHABLE: 0,
    }
    # None: the cluster's default (300 s, added by its admission plugin) applies.
    assert "tolerations" not in build_pod(replace(BASE, node_loss_toleration_s=None))["spec"]
    own = {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
    mine = build_pod(replace(BASE, tolerations=(own,)))
    assert node_loss(mine) == {UNREACHABLE: 60, NOT_READY: 10}
    everything = {"operator": "Exists"}  # tolerates every taint, forever
    assert node_loss(build_pod(replace(BASE, tolerations=(everything,)))) == {"": None}
    with pytest.raises(ValueError, match="node_loss_toleration_s=-1"):
        build_pod(replace(BASE, node_loss_toleration_s=-1))


def test_args_are_what_torchrun_itself_parses() -> None:
    args = get_args_parser().parse_args(container(build_pod(FULL))["args"])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("1:8", "gpu", "elastic-etcd")
    assert args.rdzv_endpoint == "$(KFP_ELASTIC_ETCD_ENDPOINTS)" and args.rdzv_id == "resnet-run.7"
    assert args.rdzv_conf == "join_timeout=120,lease_ttl=10"  # etcd settings come from env
    assert args.max_restarts == 5 and args.monitor_interval == 1.0
    assert args.local_addr == "$(POD_IP)"
    assert args.module is True and args.training_script == "trainer.main"
    assert args.training_script_args == ["--epochs", "3", "--snapshot", "/snapshots/resnet"]


def test_every_passthrough_field_lands_in_the_manifest() -> None:
    pod = build_pod(FULL)
    meta, spec, c = pod["metadata"], pod["spec"], container(pod)
    assert meta["name"] == "resnet-worker-3-2" and meta["namespace"] == "kfp-elastic"
    assert meta["labels"]["team"] == "vision" and meta["labels"][INDEX_LABEL] == "3"
    assert meta["labels"][ATTEMPT_LABEL] == "2" and meta["labels"][RUN_ID_LABEL] == "resnet-run.7"
    assert meta["annotations"] == dict(FULL.annotations)
    assert "ownerReferences" not in meta  # owned by the run (labels), not by a master pod
    assert spec["priorityClassName"] == "team-opportunistic"  # index 3 of min_nodes=1
    assert spec["serviceAccountName"] == "kfp-elastic-worker"
    assert spec["tolerations"][:2] == [dict(t) for t in FULL.tolerations]
    assert spec["nodeSelector"] == dict(FULL.node_selector)
    assert spec["affinity"] == dict(FULL.affinity)
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["terminationGracePeriodSeconds"] == 90
    assert spec["securityContext"]["fsGroup"] == 2000  # the snapshot PVC is writable
    assert c["image"] == FULL.image and c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == ["python", "-m", "torch.distributed.run"]
    assert c["resources"] == {
        # The 2Gi memory-backed /dev/shm on top of the 24Gi and 32Gi given.
        "requests": {"cpu": "3500m", "memory": "26Gi", "nvidia.com/gpu": "2"},
        "limits": {"cpu": "8", "memory": "34Gi", "nvidia.com/gpu": "2"},
    }
    env = env_of(pod)
    assert env["NCCL_DEBUG"] == "WARN" and env["OMP_NUM_THREADS"] == "4"
    assert env["KFP_ELASTIC_ATTEMPT"] == "2" and env["KFP_ELASTIC_JOB"] == "resnet"
    assert c["envFrom"] == [{"configMapRef": {"name": "kfp-elastic-config"}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["snapshots"]["persistentVolumeClaim"] == {"claimName": "resnet-snapshots"}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "kfp-elastic-etcd-client-tls"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {
        "/snapshots": "snapshots",
        "/etc/kfp-elastic/etcd-tls": "etcd-tls",
        "/etc/kfp-elastic/etcd-auth": "etcd-auth",
        "/dev/shm": "dshm",
    }


def test_etcd_secrets_are_mounted_files_named_by_env_and_never_in_args() -> None:
    pod = build_pod(FULL)
    c = container(pod)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["etcd-auth"]["secret"] == {
        "secretName": "kfp-elastic-etcd-password",
        "defaultMode": 0o440,
        "items": [{"key": "password", "path": "password"}],
    }
    assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"].startswith("etcd-"))
    env = env_of(pod)
    assert env["KFP_ELASTIC_ETCD_CACERT"] == "/etc/kfp-elastic/etcd-tls/ca.crt"
    assert env["KFP_ELASTIC_ETCD_CERT"] == "/etc/kfp-elastic/etcd-tls/tls.crt"
    assert env["KFP_ELASTIC_ETCD_KEY"] == "/etc/kfp-elastic/etcd-tls/tls.key"
    assert env["KFP_ELASTIC_ETCD_PASSWORD_FILE"] == "/etc/kfp-elastic/etcd-auth/password"
    assert env["KFP_ELASTIC_ETCD_USER"] == "trainer"
    # Nothing about etcd credentials in the args (visible in `kubectl get pod -o yaml` and ps).
    text = " ".join(c["args"]) + " ".join(c["command"])
    assert not any(word in text for word in ("password", "cacert", "tls.key", "etcd-auth"))
    assert "KFP_ELASTIC_ETCD_PASSWORD" not in env  # only the file's path, never a value
    plain = build_pod(BASE)
    assert not any(e["name"].startswith("KFP_ELASTIC_ETCD_") for e in container(plain)["env"])


def test_memory_limit_defaults_to_request_and_cpu_is_not_limited() -> None:
    resources = container(build_pod(replace(BASE, cpu=2, memory="8Gi")))["resources"]
    assert resources == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}


def test_each_process_snapshot_buffer_is_added_to_the_memory_request_and_limit() -> None:
    two = replace(BASE, memory="8Gi", snapshot_buffer="9Gi", nproc_per_node=2)
    resources = container(build_pod(two))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "26Gi"
    limited = container(build_pod(replace(two, memory_limit="10Gi")))["resources"]
    assert (limited["requests"]["memory"], limited["limits"]["memory"]) == ("26Gi", "28Gi")
    by_gpu = replace(two, nproc_per_node="gpu", gpu=4, snapshot_buffer="1Gi")
    assert container(build_pod(by_gpu))["resources"]["requests"]["memory"] == "12Gi"
    odd = replace(BASE, memory="1000", snapshot_buffer="24")
    assert container(build_pod(odd))["resources"]["requests"]["memory"] == "1024"
    # No memory given: no limit to overrun, nothing to add to.
    unlimited = container(build_pod(replace(BASE, snapshot_buffer="9Gi")))
    assert "memory" not in str(unlimited.get("resources", {}))


def test_a_memory_backed_dev_shm_is_added_once_to_the_memory_request_and_limit() -> None:
    # Pages written to a memory-backed emptyDir are charged to the container's memory cgroup:
    # a /dev/shm the limit did not count would OOM-kill the pod when NCCL or DataLoader
    # workers fill it.
    two = replace(BASE, memory="8Gi", shm_size="2Gi", nproc_per_node=2)
    resources = container(build_pod(two))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "10Gi"
    both = container(build_pod(replace(two, snapshot_buffer="1Gi", memory_limit="9Gi")))
    assert both["resources"]["requests"]["memory"] == "12Gi"  # 8 + 2 x 1 + 2
    assert both["resources"]["limits"]["memory"] == "13Gi"  # 9 + 2 x 1 + 2
    unlimited = container(build_pod(replace(BASE, shm_size="2Gi")))
    assert "memory" not in str(unlimited.get("resources", {}))


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "guaranteed"),
    [(1, 1, [0]), (2, 4, [0, 1]), (3, 3, [0, 1, 2]), (1, 5, [0])],
)
def test_the_first_min_indexes_are_guaranteed_the_rest_opportunistic(
    min_nodes: int, max_nodes: int, guaranteed: list[int]
) -> None:
    spec = replace(BASE, min_nodes=min_nodes, max_nodes=max_nodes)
    classes = {
        i: build_pod(replace(spec, worker_index=i, attempt=7))["spec"]["priorityClassName"]
        for i in range(max_nodes)
    }
    assert [i for i, c in classes.items() if c == "kfp-elastic-worker-guaranteed"] == guaranteed
    assert all(
        c == "kfp-elastic-worker-opportunistic" for i, c in classes.items() if i >= min_nodes
    )


def test_one_class_for_every_worker_when_both_tiers_name_it() -> None:
    # What KubernetesSettings.resolved makes of the single priority_class setting.
    spec = replace(BASE, guaranteed_priority_class="low", opportunistic_priority_class="low")
    assert {
        build_pod(replace(spec, worker_index=i))["spec"]["priorityClassName"] for i in (0, 3)
    } == {"low"}


def test_kueue_labels_name_the_queue_and_each_tiers_class() -> None:
    # One name per tier: the WorkloadPriorityClass is named as the pod's PriorityClass.
    spec = replace(BASE, min_nodes=1, max_nodes=3, kueue_queue="kfp-elastic")
    pods = [build_pod(replace(spec, worker_index=i)) for i in range(3)]
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert labels[KUEUE_QUEUE_LABEL] == "kfp-elastic"
        assert labels[KUEUE_PRIORITY_CLASS_LABEL] == pod["spec"]["priorityClassName"]
        assert "schedulingGates" not in pod["spec"]  # Kueue's webhook adds its gate
    assert [p["metadata"]["labels"][KUEUE_PRIORITY_CLASS_LABEL] for p in pods] == [
        "kfp-elastic-worker-guaranteed",
        "kfp-elastic-worker-opportunistic",
        "kfp-elastic-worker-opportunistic",
    ]
    no_class = replace(spec, guaranteed_priority_class=None)
    labels = build_pod(no_class)["metadata"]["labels"]  # Kueue takes the pod's priority
    assert labels[KUEUE_QUEUE_LABEL] == "kfp-elastic" and KUEUE_PRIORITY_CLASS_LABEL not in labels
    without = build_pod(BASE)["metadata"]["labels"]
    assert not {KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_CLASS_LABEL} & set(without)


def test_optional_identity_fields_can_be_left_to_the_cluster() -> None:
    spec = build_pod(
        replace(BASE, guaranteed_priority_class=None, service_account=None, run_as_user=None)
    )
    assert "priorityClassName" not in spec["spec"] and "serviceAccountName" not in spec["spec"]
    assert spec["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_build_is_a_pure_function_of_the_spec() -> None:
    before = copy.deepcopy(FULL)
    first = build_pod(FULL)
    first["metadata"]["labels"]["team"] = "changed"
    first["spec"]["volumes"][0]["name"] = "changed"
    assert build_pod(FULL) == build_pod(before) != first
    assert FULL == before


def _matches(selector_text: str, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (t.split("=") for t in selector_text.split(",")))


def test_selector_matches_the_pod_labels() -> None:
    labels = build_pod(BASE)["metadata"]["labels"]
    assert _matches(selector("mnist", "mnist"), labels)
    assert _matches(run_selector("mnist"), labels)


def test_a_restarted_master_adopts_only_the_pods_of_its_own_run() -> None:
    """Same job name, another run id (an earlier run's leftovers): not adopted; same run id
    under another job name: deleted by the exit handler's run selector all the same."""
    this_run = build_pod(replace(BASE, run_id="run-2"))["metadata"]["labels"]
    earlier_run = build_pod(replace(BASE, run_id="run-1"))["metadata"]["labels"]
    renamed = build_pod(replace(BASE, job_name="other", run_id="run-2"))["metadata"]["labels"]
    assert _matches(selector("mnist", "run-2"), this_run)
    assert not _matches(selector("mnist", "run-2"), earlier_run)
    assert [_matches(run_selector("run-2"), x) for x in (this_run, earlier_run, renamed)] == [
        True,
        False,
        True,
    ]


def test_manifest_passes_the_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for version in ("1.30", kubernetes_validate.latest_version()):
        for spec in (BASE, FULL):
            kubernetes_validate.validate(build_pod(spec), version, strict=True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("250m", Decimal("0.25")),
        ("2", Decimal(2)),
        ("1.5Gi", Decimal(1610612736)),
        ("4k", Decimal(4000)),
        ("1e3", Decimal(1000)),
        ("+.5", Decimal("0.5")),
        (3, Decimal(3)),
        ("-1", Decimal(-1)),
        ("1E", Decimal(10**18)),
    ],
)
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"job_name": "My_Job"}, "job_name='My_Job' is not a DNS-1123 label"),
        ({"job_name": "-job"}, "not a DNS-1123 label"),
        ({"job_name": "j" * 60}, "longer than 63 characters"),
        ({"namespace": "Kfp"}, "namespace='Kfp' is not a DNS-1123 label"),
        ({"run_id": "run/1"}, "run_id='run/1'"),
        ({"worker_index": -1}, "worker_index=-1 must be an integer >= 0"),
        ({"attempt": True}, "attempt=True must be an integer >= 0"),
        ({"min_nodes": 0}, "min_nodes=0 must be an integer >= 1"),
        ({"min_nodes": 5, "max_nodes": 4}, "min_nodes=5 > max_nodes=4"),
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nproc_per_node": "many"}, "nproc_per_node='many'"),
        ({"image": ""}, "image=''"),
        ({"image": "a b"}, "image='a b'"),
        ({"entrypoint": ""}, "entrypoint must name"),
        ({"command": ()}, "command must be"),
        ({"rdzv_endpoint": "etcd:99999"}, "rdzv_endpoint: --rdzv-endpoint entry 'etcd:99999'"),
        ({"rdzv_conf": {"joint_timeout": "1"}}, "rdzv_conf keys ['joint_timeout'] are unknown"),
        ({"rdzv_conf": {"join_timeout": "1,2"}}, "contain no ','"),
        ({"rdzv_conf": {"cacert": "/x"}}, "do not pass them in rdzv_conf"),
        ({"rdzv_conf": {"password": "x"}}, "rdzv_conf keys ['password'] are unknown"),
        ({"env": {"KFP_ELASTIC_ETCD_CACERT": "/x"}}, "is set by the launcher"),
        ({"etcd_password_secret": "pw"}, "needs env KFP_ELASTIC_ETCD_USER"),
        ({"cpu": "-1"}, "cpu='-1' must not be negative"),
        ({"memory": "-2Gi"}, "memory='-2Gi' must not be negative"),
        ({"memory": "lots"}, "memory: 'lots' is not a Kubernetes quantity"),
        ({"snapshot_buffer": "lots"}, "snapshot_buffer: 'lots' is not a Kubernetes quantity"),
        ({"cpu": "1", "cpu_limit": "500m"}, "cpu_limit='500m' is below cpu='1'"),
        ({"memory": "8Gi", "memory_limit": "4Gi"}, "memory_limit='4Gi' is below memory='8Gi'"),
        ({"gpu": -1}, "gpu=-1 must be an integer >= 0"),
        ({"gpu": 1, "gpu_resource": "bad resource"}, "gpu_resource key 'bad resource'"),
        ({"shm_size": "-1Mi"}, "shm_size='-1Mi' must not be negative"),
        ({"termination_grace_period_s": -5}, "termination_grace_period_s=-5"),
        ({"guaranteed_priority_class": "Low"}, "guaranteed_priority_class='Low' is not a DNS-1"),
        ({"opportunistic_priority_class": "a_b"}, "opportunistic_priority_class='a_b' is not"),
        ({"service_account": "sa_1"}, "service_account='sa_1'"),
        ({"kueue_queue": "Team_A"}, "kueue_queue='Team_A' is not a DNS-1123 label"),
        ({"kueue_queue": ""}, "kueue_queue='' is not a DNS-1123 label"),
        (
            {"kueue_queue": "q", "guaranteed_priority_class": "c." + "x" * 70},
            "guaranteed_priority_class: label value",
        ),
        ({"kueue_queue": "q", "labels": {KUEUE_QUEUE_LABEL: "other"}}, "set by the launcher"),
        ({"image_pull_policy": "Sometimes"}, "image_pull_policy='Sometimes'"),
        ({"labels": {JOB_LABEL: "other"}}, "set by the launcher"),
        ({"labels": {"team": "a b"}}, "label value 'a b'"),
        ({"labels": {"bad key!": "x"}}, "key 'bad key!'"),
        ({"node_selector": {"zone": "x" * 64}}, "not a valid label value"),
        ({"annotations": {"UPPER.example/x": "y"}}, "annotations key prefix"),
        ({"env": {"POD_IP": "1.2.3.4"}}, "env 'POD_IP' is set by the launcher"),
        ({"env": {"1=2": "x"}}, "env name '1=2'"),
        ({"tolerations": ({"key": "k", "operator": "In"},)}, "operator 'In'"),
        ({"tolerations": ({"operator": "Exists", "value": "v"},)}, "Exists takes no value"),
        ({"tolerations": ({"key": "k", "effect": "NoRun"},)}, "effect 'NoRun'"),
        ({"tolerations": ({"key": "k", "tolerationSeconds": 5},)}, "only applies to"),
        ({"tolerations": ({"key": "k", "colour": "red"},)}, "unknown fields ['colour']"),
        ({"volume_mounts": ({"name": "data", "mountPath": "/data"},)}, "names no volume"),
        ({"volumes": ({"name": "dshm", "emptyDir": {}},)}, "used twice (or is reserved)"),
        (
            {
                "volumes": ({"name": "d", "emptyDir": {}},),
                "volume_mounts": ({"name": "d", "mountPath": "rel"},),
            },
            "must be absolute",
        ),
    ],
)
def test_bad_input_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        build_pod(replace(BASE, **change))
    assert message in str(caught.value)
