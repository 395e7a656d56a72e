"""The etcd layer every part shares: connection settings, the client, the one key schema, and the
small shared pieces (like etcd's ``clientv3/concurrency``): lease keeper, watched prefix, leader
election with guarded writes, compare-and-put guards, JSON record readers; embedded etcd and its
throw-away PKI for local runs and tests.

Only ``pyetcd`` (and grpc; ``cryptography`` inside ``pki.generate_test_pki``) may be imported
here; rendezvous, master, worker runtime, components and tools all connect through this package.
"""
