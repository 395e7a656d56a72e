"""``torchrun ... -m kfp_elastic.worker --model-def pkg.module``: see :mod:`worker.runner`.

Any error is also written to torchrun's error file (``TORCHELASTIC_ERROR_FILE``): the agent
reads the exception and traceback from it and carries them to the master
(``rendezvous/peer_failures.py``), so the job's result says why a worker failed.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from .model_def import ModelDefError
from .runner import main

if __name__ == "__main__":
    errors = get_error_handler()
    try:
        sys.exit(main())
    except ModelDefError as error:
        errors.record_exception(error)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except Exception as error:
        errors.record_exception(error)
        raise
