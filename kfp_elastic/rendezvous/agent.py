"""``kfp-elastic agent``: torchrun, started faster; what the master runs for every worker.

It is ``torchrun`` (same arguments, same behaviour: ``torch.distributed.run.main``) except that
torch is imported with the cyclic garbage collector paused and the imported objects frozen
(``gc.freeze``). ``import torch`` builds hundreds of thousands of long-lived objects, and the
collections they trigger find no garbage: they are ≈ 40 % of a cold agent's start here, which
is on the path of a joining node (launch → registered in etcd → first step of the bigger
world; see docs/benchmarks.md). Frozen objects are also never scanned again, neither by the
agent nor by the zygote forked from it (``zygote_fork.py``), whose workers then share those
pages with it instead of copying them.

    kfp-elastic agent --rdzv-backend=elastic-etcd --rdzv-endpoint=... train.py ...
    python -m kfp_elastic.rendezvous.agent ...        (the same, with this interpreter)

Plain ``torchrun --rdzv-backend=elastic-etcd`` works as well; it only starts slower.

Exit codes: torchrun's, except 0 for a node that finds its job already done, and
``ORPHANED_EXIT_CODE`` (75) when it stopped because its run had no master for
``--rdzv-conf orphan_timeout`` seconds (``rendezvous/orphan.py``).

CUDA: the agent sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set) before torch is imported.
torchrun's ``LaunchConfig.__post_init__`` calls ``torch.cuda.is_available()`` (to choose a default
NUMA binding) whatever ``--nproc-per-node`` is, and ``--nproc-per-node gpu|auto`` counts devices;
by default these call the CUDA driver, after which torch marks every fork of the agent a "bad
fork" that cannot use CUDA: the zygote's workers failed at their first CUDA call. With the
variable set they ask NVML instead, which leaves forks usable (see ``zygote.fork_poison``).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Sequence

from kfp_elastic.rendezvous import warm_start
from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE, stopped_after

log = logging.getLogger("kfp_elastic.rendezvous.agent")
NVML_CUDA_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # read by torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(*NVML_CUDA_CHECK)  # before torchrun asks whether CUDA is there
    gc.disable()
    try:
        from torch.distributed.run import main as torchrun_main
    finally:
        gc.freeze()
        gc.enable()
    try:
        with warm_start.agent_process():
            torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except Exception as error:
        # Here, not at the top: the handler imports torch, which is imported above first, with
        # the collector paused.
        from kfp_elastic.rendezvous.handler import RunCompletedError

        if isinstance(error, RunCompletedError):
            # A replacement or spare that arrives after the job succeeded is not a failed worker.
            log.info("nothing to do, exiting 0: %s", error)
            return 0
        gone_s = stopped_after()
        if gone_s is None:
            raise
        # Stopped by the master watch (the SIGTERM it sent itself), not by a failure.
        log.error("no master for %.0f s: workers stopped, exiting %d", gone_s, ORPHANED_EXIT_CODE)
        return ORPHANED_EXIT_CODE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
