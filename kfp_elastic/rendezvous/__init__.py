"""elastic-etcd: a torchrun rendezvous backend on the etcd v3 API."""
