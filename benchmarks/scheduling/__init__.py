"""Scheduling a shared GPU cluster: gang against elastic jobs, by simulation.

Subcommands (``python -m benchmarks scheduling <subcommand> --help``):

    simulate   a discrete-event simulation of a GPU cluster replaying a trace (the default)
    exp2       serving beside training on the test cluster (``exp2``, ``serving_app``,
               ``paced_imagenet``)

Modules: ``throughput`` (seconds per step of a job type on n GPUs, from measured curves),
``trace`` (reading and sampling a trace), ``placement`` (the test cluster scheduler's ``plan``
over simulated pods), ``simulator`` (the model), ``simulate`` (the command line). Kept light:
``benchmarks/timed_model_def.py`` imports ``throughput`` in every worker.
"""
