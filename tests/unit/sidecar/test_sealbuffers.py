"""The pool of ciphertext buffers: reuse, the size window, the bound, and
which buffers it keeps when the bound is reached."""

from __future__ import annotations

from kvstrata.sidecar.sealbuffers import SealBuffers


def test_a_buffer_given_back_is_taken_again_for_an_object_of_about_its_size() -> None:
    pool = SealBuffers(max_bytes=1 << 20)
    first = pool.take(1000)
    pool.give(first)
    assert pool.take(900) is first and pool.reused_total == 1
    pool.give(first)
    # Too large for a small object (more than twice its size): a new buffer.
    small = pool.take(100)
    assert small is not first and len(small) == 100
    # Too small for a larger one.
    assert pool.take(2000) is not first


def test_beyond_the_bound_the_buffers_given_back_longest_ago_go() -> None:
    pool = SealBuffers(max_bytes=1500)
    a, b = pool.take(1000), pool.take(1000)
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes == 1000
    assert pool.take(1000) is b
    assert pool.take(1000) is not a


def test_when_the_object_size_changes_the_pool_fills_with_the_new_size() -> None:
    # 16-byte tags on 16 and then 32 "MiB" objects, scaled down: a pool full
    # of buffers too small for the new size must not refuse the new ones.
    pool = SealBuffers(max_bytes=4 * 1016)
    small = [pool.take(1016) for _ in range(4)]
    for buf in small:
        pool.give(buf)
    assert pool.free_bytes == 4 * 1016
    large = [pool.take(2032) for _ in range(2)]
    assert not any(buf is old for buf in large for old in small)
    for buf in large:
        pool.give(buf)
    assert pool.free_bytes == 2 * 2032
    again = [pool.take(2032) for _ in range(2)]
    assert {id(b) for b in again} == {id(b) for b in large} and pool.reused_total == 2


def test_a_buffer_larger_than_the_whole_bound_is_not_kept() -> None:
    pool = SealBuffers(max_bytes=1000)
    kept = pool.take(600)
    pool.give(kept)
    pool.give(pool.take(1001))
    assert pool.free_bytes == 600 and pool.take(600) is kept
