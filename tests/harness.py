"""Test-side name of :mod:`rendezvous.local_agents` (local torchrun agents as nodes)."""

from kfp_elastic.rendezvous.local_agents import *  # noqa: F403
from kfp_elastic.rendezvous.local_agents import __all__  # noqa: F401
