"""The store choice of an L2 file, kept with the file across restarts.

A request may keep its chunks out of the shared tier (``store_tiers``,
:mod:`kvstrata.sidecar.tierchoice`). L2 remembers that choice in its index;
after a restart the index is rebuilt from the files, and a file whose choice
was lost would be uploaded at its first reuse (admission ``reused``) -- the
leak the choice exists to prevent. The object format has no field for it, so
the choice goes into an extended attribute of the file (``user.`` namespace:
ext4, XFS, btrfs and tmpfs since Linux 6.6 keep them), set on the temporary
file before it is renamed into place, so a file is never seen without it.

A file whose choice cannot be recorded (the filesystem refuses extended
attributes) is not kept in L2: a lost chunk costs a miss, a lost choice could
put a prompt where its request said it must not go. Files stored with every
tier allowed carry no attribute; a file without one reads as every tier, as
files written before this existed.
"""

from __future__ import annotations

import errno
import os

from kvstrata.sidecar.tierchoice import TIER_NAMES, TierChoice

__all__ = ["ATTRIBUTE", "ChoiceNotRecorded", "read_choice", "record_choice"]

ATTRIBUTE = "user.kvstrata.store_tiers"
# What an unreadable attribute stands for: the narrowest choice a file in L2
# can have had (it is in L1's arena and on this disk).
LOCAL_ONLY: frozenset[str] = frozenset({"l1", "l2"})


class ChoiceNotRecorded(OSError):
    """The filesystem refused the attribute: the file must not be kept."""


def record_choice(path: str, choice: TierChoice) -> None:
    """Give ``path`` the attribute of ``choice`` (nothing for every tier).
    Raises :class:`ChoiceNotRecorded` when the filesystem refuses it."""
    if choice is None:
        return
    try:
        os.setxattr(path, ATTRIBUTE, ",".join(sorted(choice)).encode("ascii"))
    except OSError as exc:
        raise ChoiceNotRecorded(
            exc.errno, f"extended attribute {ATTRIBUTE}: {exc.strerror}"
        ) from exc


def read_choice(path: str) -> TierChoice:
    """The choice ``path`` was stored with: None (every tier) without the
    attribute, :data:`LOCAL_ONLY` when it cannot be understood."""
    try:
        raw = os.getxattr(path, ATTRIBUTE)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        return LOCAL_ONLY
    try:
        names = frozenset(raw.decode("ascii").split(","))
    except UnicodeDecodeError:
        return LOCAL_ONLY
    if not names or not names <= frozenset(TIER_NAMES):
        return LOCAL_ONLY
    return names
