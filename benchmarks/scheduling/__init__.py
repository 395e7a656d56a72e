"""Scheduling a shared GPU cluster: gang against elastic jobs (docs/scheduling.md).

Subcommands (``python -m benchmarks scheduling <subcommand> --help``; ``suite.py`` lists them):
``exp1``, ``admission``, ``exp2`` and ``convergence`` run on the test cluster or local agents
(``cluster_jobs``: several jobs on one test cluster, their pacing, steps and occupancy;
``occupancy``: who holds the slots over time; ``serving_app``: experiment 2's serving pods);
``simulate`` is a discrete-event simulation (``workload``: experiment 1 replayed).

Modules: ``throughput`` (seconds per step of a job type on n GPUs, from measured curves),
``trace`` (reading and sampling a trace), ``placement`` (the test cluster scheduler's ``plan``
over simulated pods), ``simulator`` (the model), ``simulate`` (the command line). Kept light:
``benchmarks/timed_model_def.py`` imports ``throughput`` in every worker.
"""
