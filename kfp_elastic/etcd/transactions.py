"""The compare-and-put patterns every etcd writer of the project shares.

Two guards cover the writes that must not overwrite someone else's: *create if absent*
(``absent``, ``put_if_absent``: the first proposal wins, for good) and *unchanged since read*
(``unchanged_since``: a compare-and-swap on the key's mod revision, read before). Writes guarded
by holding a leader key are :mod:`kfp_elastic.etcd.election`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client


def absent(client: MultiEndpointEtcd3Client, key: str) -> Any:
    """The compare "``key`` does not exist"."""
    return client.transactions.version(key) == 0


def unchanged_since(client: MultiEndpointEtcd3Client, key: str, mod_revision: int | None) -> Any:
    """The compare "``key`` is as it was read": still at ``mod_revision``, or still absent when
    it was read absent (``mod_revision`` 0 or None)."""
    if mod_revision:
        return client.transactions.mod(key) == mod_revision
    return absent(client, key)


def put_if_absent(
    client: MultiEndpointEtcd3Client,
    key: str,
    value: str | bytes,
    *,
    lease: int | None = None,
    failure: Sequence[Any] = (),
) -> tuple[bool, list[Any]]:
    """Create ``key`` (bound to ``lease``, if given) unless it exists; run ``failure`` (reads)
    if it does. Returns etcd's (succeeded, responses)."""
    tx = client.transactions
    return client.transaction(
        compare=[absent(client, key)],
        success=[tx.put(key, value, lease=lease)],
        failure=list(failure),
    )
