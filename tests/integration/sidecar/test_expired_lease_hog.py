"""A client whose write lease expired while it stays connected holds only its
own share of L1: everyone else's stores and promotions go on.

The hog is a bare ZeroMQ peer (it sends what a hostile client would): it
takes the largest write lease it may and goes silent with its session kept
alive. Its lease expires into quarantine (its slot stays pinned: it may
still be writing), and the quarantined bytes count against it, show on
/metrics and leave the rest of the arena to the other clients. Ordered by
the sidecar's counters: the expiry, the quarantine, the refusals.
"""

from __future__ import annotations

from typing import Any

from kvstrata.sidecar import protocol as p
from kvstrata.testing.rawpeer import RawPeer

L1_BYTES = 16 << 20  # the test sidecar's arena
CHUNK = 256 << 10  # the well-behaved client's chunks: 64 fill the arena
QUARTER = L1_BYTES // 4  # the defaults: chunk_max_fraction and session_write_fraction


def prepare_store(hog: RawPeer, key: bytes, nbytes: int, request_id: int) -> list[Any]:
    body = {"keys": [key], "nbytes": nbytes, "dtype": "uint8", "shape": [nbytes], "owner": "h"}
    return hog.call(p.PREPARE_STORE, body, request_id=request_id)


def test_an_expired_write_lease_pins_only_its_clients_share_of_l1(
    sidecar_factory: Any, kit: Any
) -> None:
    sidecar = sidecar_factory(overrides={"server": {"lease_seconds": 0.5}}).start()
    other = sidecar.client(client_id="other")
    hog = RawPeer(sidecar.endpoint)
    try:
        # Chunks the other client will read back from L2 once L1 has cycled.
        kept = kit.make_keys(4, seed=900)
        assert kit.store(other, kept, CHUNK, owner="kept") == 4
        kit.wait_until(
            lambda: sidecar.status()["tiers"]["l2"]["objects"] >= 4, 10, "L2 to hold them"
        )

        fingerprint = kit.NAMESPACE.fingerprint()
        hog.hello(fingerprint, client_id="hog")
        hog_keys = kit.make_keys(3, seed=901)
        # A chunk as big as the arena is refused, naming the field and the setting.
        whole = prepare_store(hog, hog_keys[0], L1_BYTES, request_id=1)
        assert whole[2] is False, whole
        assert "nbytes" in whole[3]["message"] and "chunk_max_fraction" in whole[3]["message"]
        # The largest chunk it may ask for is granted; then it goes silent.
        granted = prepare_store(hog, hog_keys[1], QUARTER, request_id=2)
        assert granted[2] is True, granted
        (slot,) = granted[3]["slots"]
        assert slot is not None and slot[2] == QUARTER  # [lease_id, offset, length, ...]

        kit.wait_until(
            lambda: sidecar.metric("kvstrata_leases_expired_total", 0.0) >= 1, 30, "the expiry"
        )
        assert sidecar.metric("kvstrata_l1_quarantined_bytes", 0.0) == QUARTER
        assert sidecar.status()["leases_active"] == 0  # quarantined, not a lease

        # Every other store goes on: more than the whole arena, in the budget's batches.
        fresh = kit.make_keys(64, seed=902)
        stored = sum(
            kit.store(other, fresh[i : i + 16], CHUNK, owner=f"f{i}") for i in range(0, 64, 16)
        )
        assert stored == 64
        # And the chunks L1 let go of come back from L2.
        promoted_before = sidecar.status()["counters"].get("promotions_total_l2", 0)
        back = kit.retrieve(other, kept, owner="read")
        assert back == [kit.payload(k, CHUNK) for k in kept]
        assert sidecar.status()["counters"].get("promotions_total_l2", 0) >= promoted_before + 4

        # The quarantined slot counts against the hog: even a small chunk is refused.
        refused_before = sidecar.metric("kvstrata_errors_total", 0.0, kind="write_budget")
        small = prepare_store(hog, hog_keys[2], CHUNK, request_id=3)
        assert small[2] is True and small[3]["slots"] == [None], small
        assert (
            sidecar.metric("kvstrata_errors_total", 0.0, kind="write_budget") == refused_before + 1
        )

        # Its writer says it is done: the slot is free and the hog may store again.
        done = hog.call(p.RELEASE, {"lease_ids": [slot[0]]}, request_id=4)
        assert done[2] is True, done
        assert sidecar.metric("kvstrata_l1_quarantined_bytes", 0.0) == 0
        again = prepare_store(hog, hog_keys[2], CHUNK, request_id=5)
        assert again[2] is True and again[3]["slots"][0] is not None, again
    finally:
        hog.close()
        other.close()
