"""kfp-elastic: elastic, preemption-proof PyTorch DDP training on Kubernetes for Kubeflow Pipelines.

Every installed import name lives under this package. The repository's top-level folders keep
their meaning and are installed as sub-packages (``pyproject.toml``'s ``package-dir``):
``rendezvous/`` → ``kfp_elastic.rendezvous``, ``master/`` → ``kfp_elastic.master``,
``worker/`` → ``kfp_elastic.worker``, ``components/`` → ``kfp_elastic.components``,
``pipelines/`` → ``kfp_elastic.pipelines``.
"""

__version__ = "0.1.0"
