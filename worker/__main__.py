"""``torchrun ... -m kfp_elastic.worker --model-def pkg.module``: see :mod:`worker.runner`."""

import sys

from .model_def import ModelDefError
from .runner import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModelDefError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
