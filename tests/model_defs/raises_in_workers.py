"""The digits example, except that it raises while a torchrun worker imports it.

The component loads the model definition itself before it starts anything (preflight): this
one passes there and fails the same way at every worker start, like a dependency missing on
the workers' image.
"""

import os

from kfp_elastic.worker.examples.digits import dataset, loss, model

__all__ = ["dataset", "loss", "model"]

if "TORCHELASTIC_RUN_ID" in os.environ:
    raise RuntimeError("raises_in_workers: this model definition is broken on the workers")
