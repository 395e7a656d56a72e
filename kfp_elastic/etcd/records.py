"""Reading the JSON records the project keeps in etcd (master state, the rendezvous' run and
closed keys, worker errors).

``decode_json`` and ``read_json`` are strict: a value that is not JSON is an error (the project
wrote it; a wrong one is a bug). ``decode_record`` is lenient, for records another process may
be writing in another version: absent, not JSON or not an object all read as None.
"""

from __future__ import annotations

import json
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client


def decode_json(value: bytes | str | None) -> Any:
    """The JSON document ``value`` holds; None for an absent key (``value`` None)."""
    return json.loads(value) if value is not None else None


def decode_record(value: bytes | str | None) -> dict[str, Any] | None:
    """The JSON object ``value`` holds; None when absent, empty, not JSON or not an object."""
    try:
        record = json.loads(value) if value else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_json(client: MultiEndpointEtcd3Client, key: str) -> Any:
    """``key``'s JSON document, None when the key is absent."""
    value, _ = client.get(key)
    return decode_json(value)


def read_json_prefix(client: MultiEndpointEtcd3Client, prefix: str) -> dict[str, Any]:
    """Every JSON document under ``prefix``, by the rest of its key after ``prefix``."""
    return {
        meta.key.decode()[len(prefix) :]: json.loads(value)
        for value, meta in client.get_prefix(prefix)
    }
