"""An L2 file keeps its request's store choice across a restart
(kvstrata.sidecar.tiers.file_choice): the re-indexed entry has the choice it
was stored with, so a chunk kept out of the shared tier stays out after the
sidecar restarts."""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers import file_choice
from kvstrata.sidecar.tiers.disk import DiskTier

CHUNK = 64 << 10
META = ChunkMeta(dtype="uint8", shape=(CHUNK,))
LOCAL = frozenset({"l1", "l2"})


def key(i: int) -> bytes:
    return bytes([i]) * 48


def test_a_reindexed_file_has_the_store_choice_it_was_written_with(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "l2", 16 << 20)
    assert tier.put(key(1), b"\x01" * CHUNK, replace(META, store_tiers=LOCAL))
    assert tier.put(key(2), b"\x02" * CHUNK, META)  # every tier: no attribute
    tier.close()

    again = DiskTier(tmp_path / "l2", 16 << 20)  # a restarted sidecar's L2
    first, second = again.peek(key(1)), again.peek(key(2))
    assert first is not None and first.meta.store_tiers == LOCAL
    assert second is not None and second.meta.store_tiers is None
    assert file_choice.ATTRIBUTE not in os.listxattr(again.path_of(key(2)))
    again.close()


@pytest.mark.parametrize(
    ("raw", "read"),
    [(b"l1,l2", LOCAL), (b"l1,shared", frozenset({"l1", "shared"})),
     (b"l9", file_choice.LOCAL_ONLY), (b"", file_choice.LOCAL_ONLY),
     (b"\xff", file_choice.LOCAL_ONLY)],
)  # fmt: skip
def test_an_attribute_is_read_as_its_names_and_anything_else_as_local_only(
    tmp_path: Path, raw: bytes, read: frozenset[str]
) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    assert file_choice.read_choice(str(path)) is None  # no attribute: every tier
    os.setxattr(path, file_choice.ATTRIBUTE, raw)
    assert file_choice.read_choice(str(path)) == read


def test_a_file_whose_choice_the_filesystem_refuses_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault double, named so: a filesystem without extended attributes (this
    # machine's filesystems all keep them) refuses setxattr with ENOTSUP.
    def refuse(*_: object) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")

    tier = DiskTier(tmp_path / "l2", 16 << 20)
    monkeypatch.setattr(file_choice.os, "setxattr", refuse)
    assert not tier.put(key(3), b"\x03" * CHUNK, replace(META, store_tiers=LOCAL))
    assert tier.put(key(4), b"\x04" * CHUNK, META)  # no choice to keep: stored
    assert tier.contains_many([key(3), key(4)]) == [False, True]
    assert not [p for p in (tmp_path / "l2").rglob("*") if ".tmp-" in p.name]
    tier.close()
