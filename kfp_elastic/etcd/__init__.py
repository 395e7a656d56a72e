"""The etcd layer every part shares: connection settings, the client, the one key schema.

Only ``pyetcd`` (and grpc) may be imported here; rendezvous, master, worker runtime, components
and tools all connect through this package.
"""
