"""EVENTS' ``lost`` counts the reader's own namespace only: another tenant's
write volume must not show through it. A real sidecar, two real clients."""

from __future__ import annotations

import hashlib
from typing import Any

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.journal import DEFAULT_CAPACITY
from kvstrata.sidecar.keys import ChunkKey, Namespace

NBYTES = 64
BUSY_TENANT = Namespace(model="a-busy-tenant", block_size=16, chunk_size=16)


def _keys(namespace: Namespace, n: int) -> list[ChunkKey]:
    fp = namespace.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"busy/{i}".encode()).digest()) for i in range(n)]


def test_a_reader_is_told_only_how_many_of_its_own_records_fell_out_of_the_ring(
    sidecar_factory: Any, kit: Any
):
    # No L2: every chunk stored is exactly one journal record (L1 stored).
    sidecar = sidecar_factory(overrides={"l2": {"enabled": False}}).start()
    reader = sidecar.client(kv_events=True)
    own = kit.make_keys(3, seed=2601)
    assert kit.store(reader, own, NBYTES, owner="r") == 3

    busy = SidecarClient(sidecar.endpoint, BUSY_TENANT, role="worker", call_timeout_s=10.0)
    # Enough of the other tenant's records to push the reader's three out of the ring.
    keys = _keys(BUSY_TENANT, DEFAULT_CAPACITY + 1000)
    for start in range(0, len(keys), 4096):
        kit.store(busy, keys[start : start + 4096], NBYTES, owner=f"b{start}")

    reply = reader.events(0, limit=16)
    assert reply is not None, reader.errors
    # Only the reader's own three records were lost (on 4edd4cb: every
    # dropped record of either tenant, about 4,000 here).
    assert reply.lost == 3
    assert all(bytes(e.key).startswith(reader.fingerprint) for e in reply.events)
    busy.close()
    reader.close()
