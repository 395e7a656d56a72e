"""The kfp-elastic job master: starts workers through a launcher (local processes or Kubernetes
pods), keeps the job between its minimum and maximum size, publishes the shard queues, records
the event timeline and recovers its own state from etcd. See docs/master.md."""
