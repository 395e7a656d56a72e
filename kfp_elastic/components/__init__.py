"""Kubeflow Pipelines components of kfp-elastic, one folder each (``component.py``, the compiled
``component.yaml``, a README). The component functions import the project inside their bodies,
so the same component runs under ``kfp.local`` (project installed) and in a cluster (the image).
"""

# The image every component runs in (and the default worker image): the project's worker image
# with kfp installed (build it with the extra that adds kfp, see docs/pipelines.md).
from kfp_elastic.job_spec import DEFAULT_WORKER_IMAGE

BASE_IMAGE = DEFAULT_WORKER_IMAGE
