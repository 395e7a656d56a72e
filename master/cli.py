"""``kfp-elastic master``: run one elastic job until it succeeds (exit 0) or fails (exit 1).

    kfp-elastic master --run-id job-1 --etcd 127.0.0.1:2379 --min-workers 2 --max-workers 3 \\
        --launcher local --dataset-length 10000 --shard-size 500 --epochs 2 \\
        --workdir /tmp/job-1 -- -m kfp_elastic.worker --model-def my_model.py

Everything after ``--`` is what each torchrun agent runs: a script and its arguments, or
``-m MODULE ...``; arguments that start with ``-`` (other than ``-m``) go to the default entry
``-m kfp_elastic.worker``. Exit codes: 0 succeeded, 1 failed (the message says why), 2 bad
arguments,
3 stepped down (SIGTERM or leadership lost; the workers keep running for the next master).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import ConfigError, EtcdSettings
from kfp_elastic.master.job import ElasticJob, JobSpec, LauncherFactory
from kfp_elastic.master.launcher import Launcher
from kfp_elastic.master.local_launcher import LocalLauncher
from kfp_elastic.master.pod_spec_checks import PASSWORD_SECRET_ENV, TLS_SECRET_ENV
from kfp_elastic.master.state import MasterState
from kfp_elastic.rendezvous.config import ETCD_KEYS

log = logging.getLogger("kfp_elastic.master")

_MODULE_FLAGS = ("-m", "--module", "--no-python", "--no_python")
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def split_entry(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(master arguments, worker entry) split at the first ``--``; the entry as torchrun gets
    it (``-m kfp_elastic.worker`` when empty or when it starts with options)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, ["-m", "kfp_elastic.worker"]
    cut = argv.index("--")
    rest = argv[cut + 1 :]
    if not rest:
        rest = ["-m", "kfp_elastic.worker"]
    elif rest[0].startswith("-") and rest[0] not in _MODULE_FLAGS:
        rest = ["-m", "kfp_elastic.worker", *rest]
    return argv[:cut], rest


def parse_conf(text: str | None, what: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected KEY=VALUE, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kfp-elastic master",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--run-id", required=True, help="torchrun --rdzv-id; names every etcd key")
    etcd_settings.add_arguments(
        p,
        endpoints_help="etcd as HOST:PORT[,HOST:PORT...] (https:// for TLS), or 'embedded' "
        "for a throw-away local etcd; every worker gets the same etcd settings",
    )
    p.add_argument(
        "--rdzv-conf",
        help="more --rdzv-conf keys for the workers, KEY=VALUE,... (not the etcd connection: "
        "the workers get the master's)",
    )
    p.add_argument("--min-workers", type=int, required=True)
    p.add_argument("--max-workers", type=int, required=True)
    p.add_argument("--nproc-per-worker", type=int, default=1, help="torchrun --nproc-per-node")
    p.add_argument("--launcher", choices=("local", "kubernetes"), default="local")
    data = p.add_argument_group("data (the master publishes the shard manifest)")
    data.add_argument("--dataset-length", type=int)
    data.add_argument("--shard-size", type=int)
    data.add_argument("--shard-manifest", help='JSON file {"shards": [[id, start, end], ...]}')
    data.add_argument("--epochs", type=int, default=1)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--no-shuffle", action="store_true")
    policy = p.add_argument_group("policy")
    policy.add_argument(
        "--max-wait",
        type=float,
        default=600.0,
        help="seconds below --min-workers before the job fails",
    )
    policy.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker errors tolerated (preemptions do not count)",
    )
    policy.add_argument(
        "--finish-grace",
        type=float,
        default=30.0,
        help="seconds workers get to exit once the job is complete",
    )
    policy.add_argument(
        "--leader-ttl",
        type=float,
        default=5.0,
        help="leader lease TTL; a dead master's successor waits this long",
    )
    p.add_argument("--metrics-port", type=int, help="serve /metrics here (0: a free port)")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--workdir", help="local launcher: worker logs and exit records")
    p.add_argument(
        "--local-capacity",
        type=int,
        help="local launcher: run at most this many workers (others stay Pending)",
    )
    k8s = p.add_argument_group("kubernetes launcher")
    k8s.add_argument("--image")
    k8s.add_argument("--namespace", help="default: the master pod's own namespace")
    k8s.add_argument("--priority-class", default="kfp-elastic-worker-low")
    k8s.add_argument("--service-account", default="kfp-elastic-worker")
    k8s.add_argument("--cpu")
    k8s.add_argument("--memory")
    k8s.add_argument("--gpu", type=int, default=0)
    k8s.add_argument("--job-name", help="pod name prefix (DNS label; default: the run id)")
    k8s.add_argument(
        "--etcd-tls-secret",
        default=os.environ.get(TLS_SECRET_ENV) or None,
        help="Secret (ca.crt, tls.crt, tls.key) that worker pods mount for etcd TLS "
        f"[env {TLS_SECRET_ENV}]",
    )
    k8s.add_argument(
        "--etcd-password-secret",
        default=os.environ.get(PASSWORD_SECRET_ENV) or None,
        help="Secret whose key 'password' worker pods mount as their etcd password file "
        f"[env {PASSWORD_SECRET_ENV}]",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def make_spec(args: argparse.Namespace, entry: Sequence[str], etcd: EtcdSettings) -> JobSpec:
    extra = {
        k: v
        for k, v in vars(args).items()
        if k in ("image", "namespace", "priority_class", "local_capacity", "workdir")
    }
    return JobSpec(
        run_id=args.run_id,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        nproc_per_worker=args.nproc_per_worker,
        epochs=args.epochs,
        max_wait_s=args.max_wait,
        max_failures=args.max_failures,
        dataset_length=args.dataset_length,
        shard_size=args.shard_size,
        shard_manifest=args.shard_manifest,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        entry=tuple(entry),
        key_prefix=etcd.key_prefix,
        launcher=args.launcher,
        finish_grace_s=args.finish_grace,
        leader_ttl_s=args.leader_ttl,
        extra=extra,
    )


def worker_rdzv_conf(args: argparse.Namespace) -> dict[str, str]:
    conf = parse_conf(args.rdzv_conf, "--rdzv-conf")
    etcd_keys = sorted(set(conf) & {*ETCD_KEYS, "password"})
    if etcd_keys:
        raise ValueError(
            f"--rdzv-conf {etcd_keys}: give the etcd connection with the --etcd-* flags "
            "(or KFP_ELASTIC_ETCD_* variables); the master hands it to every worker"
        )
    return conf


def make_launcher_factory(
    args: argparse.Namespace, spec: JobSpec, etcd: EtcdSettings
) -> LauncherFactory:
    conf = worker_rdzv_conf(args)
    endpoint = etcd.endpoint_text
    if args.launcher == "kubernetes":
        return _kubernetes_factory(args, spec, etcd, conf)
    # Local workers share this machine's files: they get the very same settings.
    env = {**etcd.to_env(), "KFP_ELASTIC_RUN_ID": spec.run_id}
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"kfp-elastic-{spec.run_id}-")
    # The worker runtime's --snapshot-dir default; local workers share the filesystem.
    env.setdefault(
        "KFP_ELASTIC_SNAPSHOT_DIR",
        os.environ.get("KFP_ELASTIC_SNAPSHOT_DIR") or str(Path(workdir).resolve() / "snapshots"),
    )

    def local(state: MasterState) -> Launcher:
        return LocalLauncher(
            run_id=spec.run_id,
            endpoint=endpoint,
            min_workers=spec.min_workers,
            max_workers=spec.max_workers,
            entry=spec.entry,
            workdir=workdir,
            nproc_per_worker=spec.nproc_per_worker,
            rdzv_conf=conf,
            env=env,
            registry=state,
            capacity=args.local_capacity,
        )

    return local


def _kubernetes_factory(
    args: argparse.Namespace, spec: JobSpec, etcd: EtcdSettings, conf: dict[str, str]
) -> LauncherFactory:
    from kubernetes import client, config

    from kfp_elastic.master.k8s_launcher import KubernetesLauncher
    from kfp_elastic.master.pod_spec import WorkerPodSpec, etcd_pod_fields

    if not args.image:
        raise ValueError("--launcher kubernetes needs --image")
    etcd_fields = etcd_pod_fields(etcd, args.etcd_tls_secret, args.etcd_password_secret)
    entry = list(spec.entry)
    if entry[0] in ("--no-python", "--no_python"):
        raise ValueError("--no-python entries are not supported by the kubernetes launcher")
    module = entry[0] in ("-m", "--module")
    script, script_args = (entry[1], entry[2:]) if module else (entry[0], entry[1:])
    namespace = args.namespace or (
        _SA_NAMESPACE.read_text().strip() if _SA_NAMESPACE.exists() else "default"
    )
    template = WorkerPodSpec(
        job_name=args.job_name or spec.run_id,
        run_id=spec.run_id,
        image=args.image,
        entrypoint=script,
        module=module,
        entrypoint_args=tuple(script_args),
        rdzv_endpoint=etcd.endpoint_text,
        min_nodes=spec.min_workers,
        max_nodes=spec.max_workers,
        nproc_per_node=spec.nproc_per_worker,
        rdzv_conf=conf,
        max_restarts=100,
        priority_class=args.priority_class,
        service_account=args.service_account,
        cpu=args.cpu,
        memory=args.memory,
        gpu=args.gpu,
        namespace=namespace,
        **etcd_fields,
    )

    class OwnClientLauncher(KubernetesLauncher):
        def close(self) -> None:
            super().close()
            api.close()

    def kubernetes(state: MasterState) -> Launcher:
        nonlocal api
        try:
            config.load_incluster_config()
        except config.ConfigException:
            # Read KUBECONFIG now: the client fixes its default path when first imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        api = client.ApiClient()
        return OwnClientLauncher(template, namespace, api)

    api: Any = None

    return kubernetes


def main(argv: Sequence[str] | None = None) -> int:
    own, entry = split_entry(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    embedded = None
    try:
        if args.etcd == "embedded":
            from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd

            embedded = EmbeddedEtcd().start()
            args.etcd = embedded.endpoint
            log.warning(
                "embedded etcd endpoint=%s: it stops with this master, so a restarted "
                "master cannot recover this run",
                args.etcd,
            )
        from kfp_elastic.etcd.client import connect

        try:
            etcd = etcd_settings.from_args(args)
            spec = make_spec(args, entry, etcd)
            spec.validate()
            factory = make_launcher_factory(args, spec, etcd)
            client = connect(etcd)
        except (ConfigError, ValueError) as error:
            parser.exit(2, f"kfp-elastic master: error: {error}\n")
        job = ElasticJob(
            spec, client, factory, metrics_port=args.metrics_port, metrics_host=args.metrics_host
        )
        signal.signal(signal.SIGINT, lambda *_: job.request_stop(cancel=True))
        signal.signal(signal.SIGTERM, lambda *_: job.request_stop(cancel=False))
        result = job.run()
        print(f"result={result.state} run={spec.run_id} message={result.message}", flush=True)
        client.close()
        return result.exit_code
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
