"""Eviction policies: the exact victim order of each, and prefix awareness."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.policies import (
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    PrefixAwarePolicy,
    S3FIFOPolicy,
    make_policy,
)


def evict(policy, n: int, keep: frozenset = frozenset()) -> list:
    """Take ``n`` victims like the engine does, skipping keys in ``keep``."""
    out = []
    for key in policy.victims():
        if key in keep:
            continue
        policy.on_remove(key)
        out.append(key)
        if len(out) == n:
            break
    return out


def test_fifo_evicts_in_insertion_order_regardless_of_hits():
    p = FIFOPolicy()
    for k in "abcd":
        p.on_insert(k, 1)
    p.on_access("a")
    assert list(p.victims()) == ["a", "b", "c", "d"]


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy()
    for k in "abcd":
        p.on_insert(k, 1)
    p.on_access("a")
    p.on_access("c")
    assert list(p.victims()) == ["b", "d", "a", "c"]


def test_lfu_evicts_fewest_hits_first_and_lru_among_equals():
    p = LFUPolicy()
    for k in "abcd":
        p.on_insert(k, 1)
    for k in "aacdd":
        p.on_access(k)
    # b: 0 hits, c: 1, a: 2 (hit before d), d: 2
    assert list(p.victims()) == ["b", "c", "a", "d"]


def test_victims_skip_leased_keys_and_never_yield_removed_ones():
    p = LRUPolicy()
    for k in "abcdef":
        p.on_insert(k, 1)
    assert evict(p, 3, keep=frozenset("ac")) == ["b", "d", "e"]
    assert list(p.victims()) == ["a", "c", "f"]


def test_s3fifo_evicts_one_hit_wonders_from_small_first():
    # capacity 10, small target 10% = 1 byte: every new key lands in small.
    p = S3FIFOPolicy(capacity_bytes=10)
    for k in "abcd":
        p.on_insert(k, 1)
    p.on_access("a")  # a was hit while in small: promoted to main, not evicted
    assert evict(p, 3) == ["b", "c", "d"]
    assert list(p.victims()) == ["a"]


def test_s3fifo_reinserts_ghost_hits_into_main():
    p = S3FIFOPolicy(capacity_bytes=10)
    for k in "xab":
        p.on_insert(k, 1)
    p.on_access("x")
    assert evict(p, 1) == ["a"]  # x moved to main; a evicted to the ghost queue
    p.on_insert("a", 1)  # back again: the ghost sends it to main
    p.on_insert("c", 1)
    # small holds b, c; both are one-hit wonders and go before main's x, a
    assert evict(p, 2) == ["b", "c"]
    assert list(p.victims()) == ["x", "a"]


def test_s3fifo_main_gives_hit_entries_another_round():
    p = S3FIFOPolicy(capacity_bytes=1000)  # small target 100 bytes: all below it
    for k in "abc":
        p.on_insert(k, 1)
    for k in "abc":
        p.on_access(k)
    # small holds 3 bytes (< 10%), so main is served first but is empty; then
    # small: every entry was hit once, so each moves to main (freq 0)
    assert evict(p, 1) == ["a"]


def test_s3fifo_skipped_victim_is_not_offered_again_in_the_same_scan():
    p = S3FIFOPolicy(capacity_bytes=10)
    for k in "abc":
        p.on_insert(k, 1)
    assert evict(p, 2, keep=frozenset("a")) == ["b", "c"]
    assert "a" in p


def test_prefix_aware_evicts_a_chain_tail_before_its_head():
    p = PrefixAwarePolicy(LRUPolicy())
    p.on_insert("h", 1)
    p.on_insert("m", 1, parent="h")
    p.on_insert("t", 1, parent="m")
    p.on_insert("z", 1)
    # Plain LRU order would be h, m, t, z.
    assert evict(p, 4) == ["t", "m", "h", "z"]


def test_prefix_aware_keeps_a_shared_head_while_any_branch_lives():
    p = PrefixAwarePolicy(LRUPolicy())
    p.on_insert("head", 1)
    p.on_insert("b1", 1, parent="head")
    p.on_insert("b2", 1, parent="head")
    p.on_access("b2")
    assert evict(p, 2) == ["b1", "b2"]
    assert evict(p, 1) == ["head"]


def test_prefix_aware_falls_back_to_a_head_whose_child_is_leased():
    p = PrefixAwarePolicy(FIFOPolicy())
    p.on_insert("h", 1)
    p.on_insert("t", 1, parent="h")
    assert evict(p, 1, keep=frozenset("t")) == ["h"]


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo", "s3fifo"])
@pytest.mark.parametrize("prefix_aware", [False, True])
def test_every_policy_yields_each_resident_key_exactly_once(name, prefix_aware):
    p = make_policy(name, capacity_bytes=100, prefix_aware=prefix_aware)
    keys = [f"k{i}" for i in range(50)]
    for i, k in enumerate(keys):
        p.on_insert(k, 2, parent=keys[i - 1] if i % 5 else None)
    for k in keys[::3]:
        p.on_access(k)
    seen = list(p.victims())
    assert sorted(seen) == sorted(keys)
    assert len(evict(p, 50)) == 50
    assert len(p) == 0


def test_unknown_policy_name_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"l1\.policy"):
        make_policy("mru", 10)


class _CountingLRU(LRUPolicy):
    """LRU that counts what the wrapper asks of it (victims taken, membership
    checks): the wrapper's work, counted rather than timed."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def victims(self):
        for key in super().victims():
            self.asked += 1
            yield key

    def __contains__(self, key) -> bool:
        self.asked += 1
        return super().__contains__(key)


def test_prefix_aware_unwinds_a_long_chain_from_its_tail_in_one_scan():
    inner = _CountingLRU()
    p = PrefixAwarePolicy(inner)
    chain = list(range(20_000))
    for i in chain:
        p.on_insert(i, 1, parent=i - 1 if i else None)
    inner.asked = 0
    order = evict(p, len(chain))
    assert order == chain[::-1]
    # Linear: a few questions to the inner policy per chunk, however long the
    # chain (a rescan per eviction would ask ~n**2 / 2 = 200 million).
    assert inner.asked <= 4 * len(chain), inner.asked
