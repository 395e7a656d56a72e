"""Moved to ``kfp_elastic.etcd.client``; this alias keeps ``master/state.py``'s import working
until that module (changed on a parallel branch) imports the etcd layer directly."""

from kfp_elastic.etcd.client import TRANSIENT_ERRORS, EtcdConnectionError, connect, retry

__all__ = ["TRANSIENT_ERRORS", "EtcdConnectionError", "connect", "retry"]
