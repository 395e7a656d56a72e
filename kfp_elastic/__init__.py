"""kfp-elastic: elastic, preemption-proof PyTorch DDP training on Kubernetes for Kubeflow Pipelines.

Every installed import name lives under this package. The repository's top-level folders keep
their meaning and are installed as sub-packages (``pyproject.toml``'s ``package-dir``):
``rendezvous/`` → ``kfp_elastic.rendezvous``, ``master/`` → ``kfp_elastic.master``,
``worker/`` → ``kfp_elastic.worker``, ``components/`` → ``kfp_elastic.components``,
``pipelines/`` → ``kfp_elastic.pipelines``, ``testing/`` → ``kfp_elastic.testing``.
"""

__version__ = "0.1.0"

# In a checkout the sub-packages are the repository's top-level folders. When the checkout's root
# is first on sys.path (``python -m`` or pytest from the root, a worktree, a copy of the tree
# beside an installed wheel), this package is the checkout's, and without this line
# ``kfp_elastic.rendezvous`` would not be found in it.
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "rendezvous" / "handler.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
del _Path, _checkout
