"""The pool of ciphertext buffers: reuse, the size window, the bound."""

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


def test_buffers_beyond_the_bound_are_not_kept() -> None:
    pool = SealBuffers(max_bytes=1500)
    a, b = pool.take(1000), pool.take(1000)
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes == 1000
    assert pool.take(1000) is a
    assert pool.take(1000) is not b
