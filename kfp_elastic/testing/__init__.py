"""Try a pipeline against a preemptible Kubernetes cluster on a laptop.

This package is what kfp-elastic's own tests and benchmarks run on, and it is installed with the
product so that users can run theirs the same way. No product module imports it.

- :mod:`.cluster`: the test cluster: an API server (``api_server``, over HTTPS, watches,
  RBAC from the manifests' Role), a scheduler with priority preemption, one kubelet per node that
  runs each pod's container as local processes, and node loss as Kubernetes does it.
- :mod:`.cluster.kfp_task`: a compiled KFP training task run as the master pod, with the command
  chain KFP's launcher runs.
- :mod:`.cluster.training_run`: one training run on the test cluster, driven end to end.
- :mod:`.cluster.chaos`: a seeded plan of disruptions, spread over a run, and its executor.
- :mod:`.nodes`: local torchrun agents as separate "nodes" (no cluster), and their events.
- :mod:`.model_defs`: model definitions that check exactly-once data (``counting``,
  ``counted_blobs``).

See docs/testing.md.
"""
