"""Loaded by every Python process the test cluster's kubelet starts (its folder leads the pod's
PYTHONPATH): points the fixed in-pod paths that code reads without asking the environment at the
host directories the kubelet mounted there.

A container would see its service-account volume at /var/run/secrets/kubernetes.io/serviceaccount;
a local process cannot (no mount namespace, no root), and the kubernetes client's
``load_incluster_config()`` reads that fixed path and hands the CA path to ssl directly, so a
path rewrite at ``open`` would not reach it. Instead, when one of the modules below is imported,
its path constants are replaced by the mapped ones. Everything else learns its paths from the
env and args, which the kubelet rewrites (see ``testing/cluster/kubelet.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path

_MOUNTS_ENV = "KFP_ELASTIC_TEST_CLUSTER_MOUNTS"
_SA = "/var/run/secrets/kubernetes.io/serviceaccount"
# module -> {attribute: path inside the pod}; the attribute's type (str or Path) is kept
_FIXED_PATHS = {
    "kubernetes.config.incluster_config": {
        "SERVICE_TOKEN_FILENAME": f"{_SA}/token",
        "SERVICE_CERT_FILENAME": f"{_SA}/ca.crt",
    },
    "kfp_elastic.master.wiring": {"SA_NAMESPACE": f"{_SA}/namespace"},
}


def _host_path(path: str, mounts: dict[str, str]) -> str | None:
    for mount_path in sorted(mounts, key=len, reverse=True):
        if path == mount_path or path.startswith(mount_path + "/"):
            return mounts[mount_path] + path[len(mount_path) :]
    return None


class _RepointFixedPaths(importlib.abc.MetaPathFinder):
    def __init__(self, mounts: dict[str, str]) -> None:
        self.mounts = mounts

    def find_spec(self, name, path, target=None):
        if name not in _FIXED_PATHS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load, mounts = spec.loader.exec_module, self.mounts

        def exec_module(module):
            load(module)
            for attribute, in_pod in _FIXED_PATHS[name].items():
                host = _host_path(in_pod, mounts)
                if host is not None and hasattr(module, attribute):
                    kind = type(getattr(module, attribute))
                    setattr(module, attribute, Path(host) if kind is not str else host)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(_MOUNTS_ENV):
    sys.meta_path.insert(0, _RepointFixedPaths(json.loads(os.environ[_MOUNTS_ENV])))
