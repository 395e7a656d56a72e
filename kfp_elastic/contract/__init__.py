"""What the job contract (``kfp_elastic/job_spec.py``) shares with the parts that run a job:
prices, Kubernetes syntax, the rendezvous settings, batch policies, the data plan and shard
manifest, the NCCL setting a worker's abort needs, and a worker's end record. Pure values and
checks (``worker_end`` adds its two etcd calls); nothing here imports above the etcd layer, so
every part may import them (docs/architecture.md).
"""
