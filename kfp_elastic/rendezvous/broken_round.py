"""A round that breaks while torchrun assigns the workers' ranks: join the next round.

torchrun's ``SimpleElasticAgent._rendezvous`` calls the handler's ``next_rendezvous`` and then
``_assign_worker_ranks``, which exchanges every node's role info through the round's store. A
node that leaves between the two (a preemption landing just as a round forms: the round took the
node in before its SIGTERM) never writes its key; the store sees the round broken and raises
:class:`~.store.RoundBrokenError` instead of waiting ``store_timeout``. torchrun does not catch
it, so the agent ended (exit 1) although nothing was wrong with it: in a preemption of several
workers at once both guaranteed workers of a job failed this way, the job stopped until its
master replaced them, and a step was lost. :func:`install` wraps ``_rendezvous`` to run it again
on that error: ``next_rendezvous`` joins the next round, as after any loss. Any other error
passes through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kfp_elastic.rendezvous.store import RoundBrokenError
from kfp_elastic.rendezvous.torchrun_hooks import wrap_once

log = logging.getLogger(__name__)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def rendezvous_again_if_broken(self: Any, worker_group: Any) -> Any:
        while True:
            try:
                return original(self, worker_group)
            except RoundBrokenError as error:
                log.warning("round broke while ranks were assigned, joining the next: %s", error)

    rendezvous_again_if_broken.__wrapped__ = original  # type: ignore[attr-defined]
    return rendezvous_again_if_broken


def install() -> None:
    """Wrap torchrun's ``SimpleElasticAgent._rendezvous`` once per process."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    wrap_once(SimpleElasticAgent, "_rendezvous", _wrap)
