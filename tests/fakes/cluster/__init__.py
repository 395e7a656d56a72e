"""The test cluster: the fake API server (``tests/fakes/fake_k8s.py``, over HTTPS), a scheduler
(``scheduler.py``) and one kubelet per node (``kubelet.py``) that runs pods as local processes.
See docs/kubernetes-launcher.md, "The test cluster"."""

from tests.fakes.cluster.cluster import TestCluster

__all__ = ["TestCluster"]
