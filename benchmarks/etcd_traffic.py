"""How much each node asks of etcd while a round forms, from etcd's own ``/metrics``.

Seconds on one 2-core machine add up every simulated node's CPU; the requests and watch
messages per node do not depend on the machine. A protocol whose per-node counts stay flat from
N = 8 to N = 128 forms a round in about the same time on N hosts, whatever one shared machine
shows. Counted from etcd's gRPC server metrics (``--metrics=basic``, etcd's default):

- ``requests``: unary calls handled (Range, Put, Txn, LeaseGrant, LeaseRevoke, ...)
- ``stream_messages_in``: messages received on streams (watch creates/cancels, lease keepalives)
- ``watch_messages_out``: watch responses sent (each may carry several events)
- ``bytes_out``: bytes etcd sent to clients (a read of all N records shows up here)
"""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")


def scrape(endpoint: str, timeout: float = 5.0) -> dict[str, float]:
    """Totals of the counters above for the etcd serving ``endpoint`` (``HOST:PORT``)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    totals = {
        "requests": 0.0,
        "stream_messages_in": 0.0,
        "watch_messages_out": 0.0,
        "bytes_out": 0.0,
    }
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            if line.startswith("etcd_network_client_grpc_sent_bytes_total "):
                totals["bytes_out"] += float(line.split()[-1])
            continue
        name, labels, value = match["name"], match["labels"], float(match["value"])
        if name == "grpc_server_handled_total" and 'grpc_type="unary"' in labels:
            totals["requests"] += value
        elif name == "grpc_server_msg_received_total" and 'grpc_type="unary"' not in labels:
            totals["stream_messages_in"] += value
        elif name == "grpc_server_msg_sent_total" and 'grpc_method="Watch"' in labels:
            totals["watch_messages_out"] += value
    return totals


def per_node(before: dict[str, float], after: dict[str, float], nodes: int) -> dict[str, float]:
    """What the ``nodes`` nodes cost etcd between two scrapes, per node."""
    return {key: round((after[key] - before[key]) / max(1, nodes), 2) for key in before}
