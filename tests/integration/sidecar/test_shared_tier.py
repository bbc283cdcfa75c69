"""Two sidecars (two pods) sharing chunks through a real Valkey-protocol server."""

from __future__ import annotations

from typing import Any

NBYTES = 4096


def test_a_chunk_stored_through_one_sidecar_is_a_shared_hit_for_another(
    sidecar_factory: Any, kit: Any, valkey: Any
):
    shared = kit.shared_valkey(valkey.url)
    a = sidecar_factory("a", {"shared": shared}).start()
    b = sidecar_factory("b", {"shared": shared}).start()
    writer, reader = a.client(), b.client()
    keys = kit.make_keys(5, seed=30)
    assert kit.store(writer, keys, NBYTES, owner="w") == 5

    def all_shared() -> Any:
        reply = reader.lookup(keys, prefetch=False, owner="r")
        return reply if reply is not None and reply.hit_chunks == 5 else None

    reply = kit.wait_until(all_shared, 15, "write-behind into the shared tier")
    assert reply.tiers == ["valkey"] * 5
    assert kit.retrieve(reader, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    # Promoted into the reader's L1 by the retrieve.
    assert reader.lookup(keys, prefetch=False, owner="r").tiers == ["l1"] * 5
    writer.close()
    reader.close()
    a.stop()
    b.stop()
