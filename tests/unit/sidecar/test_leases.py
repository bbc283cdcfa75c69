"""Lease bookkeeping: leases by owner and by age."""

from __future__ import annotations

from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.leases import LeaseTable
from kvstrata.sidecar.objformat import ChunkMeta

META = ChunkMeta("bfloat16", (2, 3))


def test_leases_are_found_by_owner_and_by_age():
    table = LeaseTable()
    entry = Entry(b"k" * 48, 0, 512, META)
    a = table.new(entry, "a", write=False)
    b = table.new(entry, "b", write=True)
    assert len({a.lease_id, b.lease_id}) == 2
    assert [lease.slot for lease in table.pop_owner("a")] == [a]
    assert table.pop_owner("a") == []
    assert table.pop_older_than(0.0) == []  # created after monotonic time 0
    assert [lease.slot for lease in table.pop_older_than(float("inf"))] == [b]
    assert len(table) == 0


def test_a_clients_leases_and_write_bytes_are_counted_from_its_owners():
    table = LeaseTable()
    entry = Entry(b"k" * 48, 0, 512, META)
    write = table.new(entry, "s1/req-a", write=True)
    table.new(entry, "s1/req-b", write=False)
    table.new(entry, "s2/req-a", write=True)
    table.new(entry, "engine", write=False)  # no "/": a client of its own
    assert table.write_bytes("s1") == 512
    assert table.counts() == {"s1": 2, "s2": 1, "engine": 1}
    table.pop(write.lease_id)
    assert table.write_bytes("s1") == 0
    assert [lease.owner for lease in table.pop_client("s1")] == ["s1/req-b"]
    assert table.counts() == {"s2": 1, "engine": 1}


def test_a_quarantined_write_lease_still_counts_against_its_client_until_its_writer_is_done():
    table = LeaseTable()
    entry = Entry(b"k" * 48, 0, 512, META)
    slot = table.new(entry, "s1/req-a", write=True)
    (expired,) = table.pop_older_than(float("inf"))
    table.quarantine(expired)
    assert len(table) == 0 and table.write_bytes("s1") == 0
    assert table.held_bytes("s1") == 512 and table.quarantined_total == 512
    assert table.quarantined_ids("s1") == [slot.lease_id]
    assert table.unquarantine(slot.lease_id, client="s2") is None  # not another client's
    assert table.unquarantine(slot.lease_id, client="s1") is expired
    assert table.held_bytes("s1") == 0 and table.quarantined_total == 0
    assert table.unquarantine(slot.lease_id) is None
