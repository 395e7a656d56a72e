"""torchrun joins the next round when the one it joined breaks during rank assignment
(``rendezvous/broken_round.py``) instead of ending the agent."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from kfp_elastic.rendezvous import broken_round
from kfp_elastic.rendezvous.store import RoundBrokenError


class _Agent:
    """Stands for torchrun's agent: each ``_rendezvous`` call takes the next outcome."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes
        self.calls = 0

    def rendezvous(self, worker_group: Any) -> Any:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_a_round_that_breaks_during_rank_assignment_is_followed_by_the_next() -> None:
    agent = _Agent([RoundBrokenError("round of /r/store/8/ broke"), RoundBrokenError("9"), "ok"])
    wrapped = broken_round._wrap(lambda self, group: self.rendezvous(group))
    assert wrapped(agent, "group") == "ok" and agent.calls == 3


@pytest.mark.parametrize(
    "error", [dist.DistStoreError("keys not set within 300s"), RuntimeError("boom")]
)
def test_any_other_error_ends_the_rendezvous_as_before(error: Exception) -> None:
    agent = _Agent([error, "never reached"])
    wrapped = broken_round._wrap(lambda self, group: self.rendezvous(group))
    with pytest.raises(type(error)):
        wrapped(agent, "group")
    assert agent.calls == 1


def test_the_handler_installs_it_on_torchruns_agent_once(make_handler) -> None:
    make_handler(1, 2)
    make_handler(1, 2)
    installed = SimpleElasticAgent._rendezvous
    assert installed.__name__ == "rendezvous_again_if_broken"
    assert installed.__wrapped__.__name__ == "_rendezvous"  # type: ignore[attr-defined]
    broken_round.install()  # again: nothing changes
    assert SimpleElasticAgent._rendezvous is installed
