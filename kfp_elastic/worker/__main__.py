"""``torchrun ... -m kfp_elastic.worker --model-def pkg.module``: see :mod:`worker.runner`.

Any error, a wrong command line included, is also written to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``): the agent reads the exception and traceback from it and carries
them to the master (``rendezvous/peer_failures.py``), so the job's result says why a worker
failed.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from kfp_elastic.worker.model_def import ModelDefError
from kfp_elastic.worker.options import OptionsError
from kfp_elastic.worker.runner import main as run


def main(argv: list[str] | None = None) -> int:
    """The runtime as a worker process runs it; exit code 2 for a wrong command line or model
    definition (both recorded, like any other error)."""
    errors = get_error_handler()
    try:
        return run(argv)
    except OptionsError as error:
        errors.record_exception(error)
        sys.stderr.write(f"{error.usage}kfp-elastic worker: error: {error}\n")
        return 2
    except ModelDefError as error:
        errors.record_exception(error)
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        errors.record_exception(error)
        raise


if __name__ == "__main__":
    sys.exit(main())
