"""kfp-elastic: elastic, preemption-proof PyTorch DDP training on Kubernetes for Kubeflow Pipelines.

Every import name lives under this package and resolves to its file below this folder
(``kfp_elastic.master.scaling`` is ``kfp_elastic/master/scaling.py``); docs/architecture.md
draws the parts and what each may import.
"""

__version__ = "0.1.0"
