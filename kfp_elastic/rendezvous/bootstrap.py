"""Where a round's workers bootstrap (MASTER_ADDR/PORT), published by rank 0 under ``rdzv/``.

torch's ``RendezvousStoreInfo.build`` has rank 0 set two store keys and every other node read
them: per node a store read, a watch, a second and a third read — about 2 ms of CPU each, most
of a round's formation at N = 128 on 2 cores. The key ``rdzv/rank0`` instead reaches every node
through the watch it has anyway (narrowed or not), and when the leader is rank 0 (the first
round, normally) it is written in the round's own transaction. torch's two store keys are
written in the same transaction for whoever reads those.
"""

from __future__ import annotations

import contextlib

from pyetcd.client import MultiEndpointEtcd3Client
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.etcd.watched_prefix import WatchedPrefix
from kfp_elastic.rendezvous.round_formation import MasterRecord


def master_ops(
    client: MultiEndpointEtcd3Client,
    keys: RunKeys,
    round_number: int,
    node_id: str,
    addr: str,
    run_lease: int,
) -> list[object]:
    """Transaction operations that publish us as round ``round_number``'s rank 0. The port
    is free on our host now, as torch's ``RendezvousStoreInfo.build`` picks it."""
    record = MasterRecord(round_number, node_id, addr, get_free_port())
    store = keys.store(round_number)
    tx = client.transactions
    return [
        tx.put(keys.rank0, record.to_json(), lease=run_lease),
        tx.put(f"{store}{RendezvousStoreInfo.MASTER_ADDR_KEY}", record.addr, lease=run_lease),
        tx.put(f"{store}{RendezvousStoreInfo.MASTER_PORT_KEY}", str(record.port), lease=run_lease),
    ]


def cached_master(
    cache: WatchedPrefix,
    keys: RunKeys,
    round_number: int,
) -> MasterRecord | None:
    """Round ``round_number``'s bootstrap address, once its rank 0 published it."""
    entry = cache.get(keys.rank0)
    if entry is None:
        return None
    with contextlib.suppress(ValueError, KeyError):
        record = MasterRecord.from_json(entry.value)
        if record.round == round_number:
            return record
    return None
