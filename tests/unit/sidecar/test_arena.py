"""The L1 arena: a named shared-memory segment another process can map."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstrata.sidecar.arena import Arena
from kvstrata.testing.residency import resident_bytes

_CHILD = r"""
import sys
from pathlib import Path
from kvstrata.sidecar.arena import Arena
arena = Arena.attach(sys.argv[1])
assert bytes(arena.buffer[100:105]) == b"hello", bytes(arena.buffer[100:105])
arena.buffer[200:205] = b"world"
arena.close()
"""


def test_a_second_process_maps_the_same_bytes():
    with Arena(1 << 20) as arena:
        arena.buffer[100:105] = b"hello"
        subprocess.run([sys.executable, "-c", _CHILD, arena.name], check=True, timeout=60)
        assert bytes(arena.buffer[200:205]) == b"world"
        assert os.path.exists(arena.path), "a client's close must not unlink the segment"
    assert not os.path.exists(arena.path)


def test_the_segment_is_private_to_the_user_and_sized_exactly():
    with Arena(3 << 20) as arena:
        st = os.stat(arena.path)
        assert st.st_size == 3 << 20
        assert st.st_mode & 0o777 == 0o600
        assert not arena.pinned  # pin_memory defaults off


def test_a_stale_segment_of_the_configured_name_is_replaced(tmp_path):
    name = f"kvstrata-test-stale-{os.getpid()}"
    with open(f"/dev/shm/{name}", "wb") as fh:
        fh.write(b"left over by a crashed sidecar")
    with Arena(1 << 20, name=name) as arena:
        assert os.stat(arena.path).st_size == 1 << 20
        assert bytes(arena.buffer[:4]) == b"\0\0\0\0"
    assert not os.path.exists(f"/dev/shm/{name}")


def test_close_with_views_still_alive_unlinks_and_does_not_crash():
    arena = Arena(1 << 20)
    view = arena.buffer[0:10]
    arena.close()
    assert not os.path.exists(arena.path)
    view[0:1] = b"x"  # the mapping lives on with its views
    arena.close()  # idempotent


@pytest.mark.parametrize("name", ["a/b", "/", ".."])
def test_bad_segment_names_are_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=r"l1\.shm_name"):
        Arena(1 << 20, name=name)


def test_pinning_without_cuda_leaves_the_arena_pageable():
    with Arena(1 << 20, pin_memory=True) as arena:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        assert arena.pinned == has_cuda


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_every_page_is_mapped_ahead_of_use_by_creator_and_attacher():
    size = 64 << 20
    with Arena(size, prefault=False) as cold:
        # The segment's pages exist (fallocate), but none is in the page table yet.
        assert resident_bytes(cold.address()) == 0
        assert cold.prefaulter is None
    with Arena(size) as arena:
        assert arena.prefaulter is not None
        assert arena.prefaulter.done.wait(60), "populating 64 MiB did not finish"
        assert arena.prefaulter.populated_bytes == size
        assert resident_bytes(arena.address()) == size
        assert bytes(arena.buffer[:4096]) == bytes(4096), "populating changed the bytes"
        client = Arena.attach(arena.name)
        try:
            assert client.prefaulter is not None and client.prefaulter.done.wait(60)
            assert resident_bytes(client.address()) == size
        finally:
            client.close()


def test_close_stops_the_populating_thread_before_unmapping():
    arena = Arena(256 << 20)
    prefaulter = arena.prefaulter
    assert prefaulter is not None
    arena.close()
    assert not prefaulter._thread.is_alive()
    assert prefaulter.populated_bytes <= 256 << 20


def test_a_kernel_without_populate_leaves_the_arena_as_it_was(monkeypatch):
    """Fault stand-in: madvise answering EINVAL, as kernels before 5.14 do."""
    import ctypes
    import errno

    from kvstrata.sidecar import prefault

    def refusing_madvise(address: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(prefault, "_madvise", lambda: refusing_madvise)
    with Arena(4 << 20) as arena:
        assert arena.prefaulter is not None
        arena.prefaulter._thread.join(60)
        assert not arena.prefaulter.supported
        assert not arena.prefaulter.done.is_set()
        arena.buffer[:5] = b"still"
        assert bytes(arena.buffer[:5]) == b"still"
