"""Example model definitions for ``--model-def``."""
