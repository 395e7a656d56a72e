"""The test cluster: the fake API server (``testing/api_server.py``, over HTTPS), a scheduler
(``scheduler.py``) and one kubelet per node (``kubelet.py``) that runs pods as local processes.
See docs/kubernetes-launcher.md, "The test cluster"."""

from kfp_elastic.testing.cluster.cluster import TestCluster

__all__ = ["TestCluster"]
