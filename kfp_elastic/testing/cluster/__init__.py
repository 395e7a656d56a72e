"""The test cluster: the fake API server (``testing/api_server.py``, over HTTPS), a scheduler
(``scheduler.py``), one kubelet per node (``kubelet.py``) that runs pods as local processes, and
the node lifecycle controller (``node_lifecycle.py``). See docs/kubernetes-launcher.md, "The test
cluster"."""

from kfp_elastic.testing.cluster.cluster import TestCluster
from kfp_elastic.testing.cluster.node_lifecycle import FAST_NODE_LIFECYCLE, NodeLifecycleSettings

__all__ = ["FAST_NODE_LIFECYCLE", "NodeLifecycleSettings", "TestCluster"]
