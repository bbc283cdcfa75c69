"""A folder of encryption keys laid out the way the kubelet mounts a Secret.

The kubelet writes a Secret's files into a fresh timestamped directory,
points ``..data`` at it by renaming a new symlink over the old one (one
atomic step), and keeps one symlink per file name into ``..data``. A key
rotation reaches a running sidecar exactly that way; :class:`MountedSecret`
does the same so tests exercise the sidecar's reload on the real layout.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from kvstrata.sidecar.sealing import INDEX_FILE, KEY_SUFFIX

__all__ = ["MountedSecret", "key_files"]


def key_files(keys: Mapping[str, bytes], writing: str) -> dict[str, bytes]:
    """The files of a key Secret: one ``<id>.key`` each and the index naming ``writing``."""
    files = {f"{key_id}{KEY_SUFFIX}": material for key_id, material in keys.items()}
    files[INDEX_FILE] = f'{{"writing": "{writing}"}}'.encode()
    return files


class MountedSecret:
    """A Secret volume at ``path``; :meth:`publish` replaces its content atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._versions = itertools.count(1)

    def publish(self, files: Mapping[str, bytes]) -> None:
        """Swap the folder's content for ``files``, as the kubelet does."""
        version = f"..2026_01_01_00_00_00.{next(self._versions):06d}"
        target = self.path / version
        target.mkdir()
        for name, data in files.items():
            (target / name).write_bytes(data)
        data_link = self.path / "..data"
        old = os.readlink(data_link) if data_link.is_symlink() else None
        tmp_link = self.path / "..data_tmp"
        tmp_link.symlink_to(version)
        os.replace(tmp_link, data_link)
        for name in files:
            link = self.path / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)
        for entry in self.path.iterdir():
            if not entry.name.startswith("..") and entry.name not in files:
                entry.unlink()
        if old is not None:
            shutil.rmtree(self.path / old)
