"""LOOKUP answers what a retrieve then gets: a key that holds a partial chunk
is no full-chunk hit (and a full chunk is no partial one), in L1 and in L2.
A real sidecar and a real client over its ZeroMQ socket."""

from __future__ import annotations

from typing import Any

NBYTES = 4096
BLOCKS = 3  # a partial chunk of three blocks


def _store(kit: Any, client: Any, keys: list[Any], blocks: int) -> None:
    slots = client.prepare_store(keys, NBYTES, "uint8", (NBYTES,), "w", blocks=blocks)
    assert slots is not None and all(s is not None for s in slots), client.errors
    for key, slot in zip(keys, slots, strict=True):
        client.arena[slot.offset : slot.offset + slot.length] = kit.payload(key, slot.length)
    assert client.commit_store([s.lease_id for s in slots], [True] * len(slots))


def _lookup_then_retrieve(client: Any, keys: list[Any], partials: list[list[Any]]) -> tuple:
    reply = client.lookup(keys, prefetch=False, owner="r", partials=partials)
    assert reply is not None, client.errors
    slots = client.prepare_retrieve(keys, "r")
    assert slots is not None, client.errors
    got = next((i for i, s in enumerate(slots) if s is None), len(slots))
    assert client.release([s.lease_id for s in slots if s is not None])
    return reply, got


def test_lookup_counts_a_chunk_only_when_the_retrieve_would_get_it(sidecar: Any, kit: Any):
    client = sidecar.client()
    full = kit.make_keys(4, seed=2670)
    odd = kit.make_keys(2, seed=2671)  # odd[0]: a partial under a key asked as full
    _store(kit, client, full[:2] + full[3:], blocks=0)
    _store(kit, client, odd, blocks=BLOCKS)
    keys = [full[0], full[1], odd[0], full[3]]
    # Candidate partials after two chunks: full[3] (a full chunk), then odd[1] (a partial).
    partials = [[], [], [full[3], odd[1]]]

    for where in ("l1", "l2"):
        reply, got = _lookup_then_retrieve(client, keys, partials)
        # On 4edd4cb: 3 hits (the partial counted as a full chunk), 2 retrieved.
        assert reply.hit_chunks == got == 2, where
        assert reply.tiers == [where, where]
        assert reply.partial == 1  # the real partial, odd[1]; never the full chunk full[3]
        if where == "l1":
            kit.wait_until(
                lambda: sidecar.status()["tiers"]["l2"]["objects"] >= 5, 30, "L2 write-behind"
            )
            client.close()
            sidecar.restart()  # L1 is gone: the same questions, answered from L2
            client = sidecar.client()
    client.close()
