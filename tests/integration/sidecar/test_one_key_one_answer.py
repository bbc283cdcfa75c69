"""Keys name content: every tier answers a key with the same bytes, before a
restart and after it.

A key held only in L2 is answered as already stored when a client stores it
again with other bytes (as L1 does). A key held only in the shared tier
(a real Valkey-protocol server) keeps its first writer's bytes there, and the
sidecar that stored other bytes under it drops its own L1 and L2 copies once
its upload finds the key taken: from then on it reads the shared bytes.
Ordered by the sidecars' counters, not the clock.
"""

from __future__ import annotations

from typing import Any

from kvstrata.connector.client import SidecarClient

NBYTES = 4096
FIRST, OTHER = b"\x11" * NBYTES, b"\xee" * NBYTES


def store_bytes(client: SidecarClient, key: bytes, data: bytes) -> bool:
    """Store ``data`` under ``key``; False when the sidecar gave no slot."""
    (slot,) = client.prepare_store([key], len(data), "uint8", (len(data),), "w") or [None]
    if slot is None:
        return False
    assert client.arena is not None
    client.arena[slot.offset : slot.offset + slot.length] = data
    assert client.commit_store([slot.lease_id], [True]), client.errors
    return True


def read(client: SidecarClient, key: bytes) -> bytes | None:
    (slot,) = client.prepare_retrieve([key], "r") or [None]
    if slot is None:
        return None
    assert client.arena is not None
    data = bytes(client.arena[slot.offset : slot.offset + slot.length])
    client.release([slot.lease_id])
    return data


def counter(sidecar: Any, name: str) -> int:
    return int(sidecar.status()["counters"].get(name, 0))


def test_a_key_only_l2_holds_is_answered_as_stored_and_keeps_its_bytes(
    sidecar: Any, kit: Any
) -> None:
    (key,) = kit.make_keys(1, seed=950)
    client = sidecar.client()
    assert store_bytes(client, key, FIRST)
    kit.wait_until(lambda: sidecar.status()["tiers"]["l2"]["objects"] >= 1, 10, "the L2 copy")
    client.close()
    sidecar.restart()  # L1 is empty; L2 keeps its files

    client = sidecar.client()
    deduplicated = counter(sidecar, "store_deduplicated_total")
    assert not store_bytes(client, key, OTHER)
    assert counter(sidecar, "store_deduplicated_total") == deduplicated + 1
    assert read(client, key) == FIRST
    client.close()
    sidecar.restart()
    client = sidecar.client()
    assert read(client, key) == FIRST
    client.close()


def test_a_key_only_the_shared_tier_holds_keeps_its_first_bytes_in_every_tier(
    sidecar_factory: Any, kit: Any, valkey: Any
) -> None:
    shared = kit.shared_valkey(valkey.url)
    first = sidecar_factory("first", {"shared": shared}).start()
    second = sidecar_factory("second", {"shared": shared}).start()
    (key,) = kit.make_keys(1, seed=951)
    writer, other = first.client(), second.client()
    assert store_bytes(writer, key, FIRST)

    def in_valkey() -> bool:
        reply = other.lookup([key], prefetch=False, owner="l")
        return reply is not None and reply.tiers == ["valkey"]

    kit.wait_until(in_valkey, 15, "the first writer's upload")
    # The second sidecar holds the key in neither L1 nor L2: it takes the store...
    assert store_bytes(other, key, OTHER)
    # ...and its upload finds the key taken: its own copies yield, L2's too
    # (once every write-behind of the chunk has ended).
    kit.wait_until(
        lambda: second.status()["tiers"]["valkey"]["deduplicated_total"] >= 1,
        15,
        "the upload's answer (the key is taken)",
    )
    kit.wait_until(
        lambda: counter(second, "writeback_pinned_bytes") == 0, 15, "write-behind to end"
    )
    assert read(other, key) == FIRST
    assert read(writer, key) == FIRST
    assert counter(second, "shared_already_held_total") == 1
    other.close()
    second.restart()
    other = second.client()
    assert read(other, key) == FIRST
    other.close()
    writer.close()
