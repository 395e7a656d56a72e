"""Kubeflow Pipelines of kfp-elastic: DAG definitions, their compiled YAML, a local runner."""
