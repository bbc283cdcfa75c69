"""L2 files past the page cache: the same bytes on disk as a buffered write,
objects of every size across segment boundaries, nothing left resident in
the page cache, and a filesystem that refuses O_DIRECT served buffered.

What the kernel holds is read back with util-linux's ``fincore`` (resident
bytes of a file), not inferred from timings."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstrata.sidecar.objformat import ChunkMeta, encode_bytes
from kvstrata.sidecar.tiers import direct_io
from kvstrata.sidecar.tiers.disk import DiskTier

from ...conftest import make_key, payload_for

META = ChunkMeta("uint8", (1,))
SEG = direct_io.SEGMENT_BYTES
# Around the alignment unit and the segment, where the copies through the
# buffer change shape (the header, a few hundred bytes, comes first).
SIZES = [1, 4095, 4096, 4097, SEG - 300, SEG, SEG + 4096 + 17, 2 * SEG + 5]


def _direct_dir(tmp_path: Path) -> Path:
    """``tmp_path``, which must take O_DIRECT for these tests to mean anything."""
    if not direct_io.supported(str(tmp_path)):
        pytest.skip(f"the filesystem under {tmp_path} has no O_DIRECT")
    return tmp_path


def _resident_bytes(path: str) -> int:
    if shutil.which("fincore") is None:
        pytest.fail("fincore (util-linux) is needed: make system-deps installs it")
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0])


def _meta(n: int) -> ChunkMeta:
    return ChunkMeta("uint8", (n,))


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_file_holds_the_bytes_a_buffered_one_does_and_reads_back(tmp_path, size):
    root = _direct_dir(tmp_path)
    direct, buffered = DiskTier(root / "d", 64 << 20), DiskTier(root / "b", 64 << 20, direct=False)
    key = make_key(size)
    payload = payload_for(key, size)
    assert direct.put(key, payload, _meta(size)) and buffered.put(key, payload, _meta(size))
    assert direct.direct_io  # the filesystem took it
    with open(direct.path_of(key), "rb") as fh:
        on_disk = fh.read()
    # The objformat layout, byte for byte: no padding left behind.
    assert on_disk == encode_bytes(key, payload, _meta(size))
    with open(buffered.path_of(key), "rb") as fh:
        assert fh.read() == on_disk
    for tier in (direct, buffered):
        out = bytearray(size + 8)
        assert tier.read_into(key, memoryview(out)) == _meta(size)
        assert bytes(out[:size]) == payload
    # Each reads the other's files: a tier's direct_io setting is no format.
    again = DiskTier(root / "b", 64 << 20)
    out = bytearray(size)
    assert again.read_into(key, memoryview(out)) == _meta(size)
    assert bytes(out) == payload


def test_direct_writes_and_reads_leave_nothing_in_the_page_cache(tmp_path):
    root = _direct_dir(tmp_path)
    key = make_key(7)
    size = 8 << 20
    payload = payload_for(key, size)
    direct, buffered = DiskTier(root / "d", 64 << 20), DiskTier(root / "b", 64 << 20, direct=False)
    assert direct.put(key, payload, _meta(size)) and buffered.put(key, payload, _meta(size))
    assert direct.read_into(key, memoryview(bytearray(size))) == _meta(size)
    # The buffered tier's file sits in the page cache whole; the direct one's
    # at most its first page (the re-index reads headers through the cache).
    assert _resident_bytes(buffered.path_of(key)) >= size
    assert _resident_bytes(direct.path_of(key)) <= direct_io.ALIGN


def test_a_flipped_byte_in_a_direct_file_is_a_counted_miss(tmp_path):
    root = _direct_dir(tmp_path)
    tier = DiskTier(root, 64 << 20)
    key = make_key(11)
    size = SEG + 100  # the damage lands in the second segment
    assert tier.put(key, payload_for(key, size), _meta(size))
    path = tier.path_of(key)
    with open(path, "r+b") as fh:
        fh.seek(SEG + 50)
        byte = fh.read(1)
        fh.seek(SEG + 50)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert tier.read_into(key, memoryview(bytearray(size))) is None
    assert tier.stats().corrupt_total == 1
    assert not os.path.exists(path)


def test_a_filesystem_refusing_o_direct_at_open_is_served_buffered_and_the_log_says_so(
    tmp_path, monkeypatch, caplog
):
    """Older kernels' tmpfs refused O_DIRECT at open (EINVAL); this machine's
    filesystems all take it, so the refusal is a stand-in (named so) on the
    real ``os.open``."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):  # fault stand-in
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    tier = DiskTier(tmp_path, 16 << 20)
    key = make_key(5)
    with caplog.at_level(logging.INFO, logger="kvstrata.sidecar.tiers.disk"):
        assert tier.put(key, payload_for(key, 10_000), _meta(10_000))
    assert not tier.direct_io
    assert "no direct I/O" in caplog.text
    out = bytearray(10_000)
    assert tier.read_into(key, memoryview(out)) == _meta(10_000)
    assert bytes(out) == payload_for(key, 10_000)
    assert tier.stats().errors_total == {}


def test_a_write_refused_after_the_open_is_written_again_through_the_page_cache(
    tmp_path, monkeypatch
):
    """Some filesystems take O_DIRECT at open and refuse the write (EINVAL);
    none at hand does, so this fault is a stand-in (named so)."""
    root = _direct_dir(tmp_path)
    tier = DiskTier(root, 16 << 20)

    def refusing_write_object(fd: int, pieces: list[memoryview]) -> int:  # fault stand-in
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io, "write_object", refusing_write_object)
    key = make_key(6)
    assert tier.put(key, payload_for(key, 5000), _meta(5000))
    assert not tier.direct_io
    assert tier.stats().errors_total == {}
    out = bytearray(5000)
    assert tier.read_into(key, memoryview(out)) == _meta(5000)
    assert bytes(out) == payload_for(key, 5000)
    assert [p.name for p in Path(tier.path_of(key)).parent.iterdir()] == [
        Path(tier.path_of(key)).name
    ]  # the refused temporary file is gone
