"""The sidecar's L1 arena as the client maps it, and the slots of it the sidecar hands out.

Why a module of its own: a slot is a byte range the sidecar names in a
reply, and the client copies through it into shared memory. What the
mapping is (:class:`MappedArena`: the segment attached, its page table
filled as asked) and whether a reply's slots may be trusted
(:func:`slots_in_arena`: one per key asked for, each inside the segment)
are decided here, apart from the session that carries the replies
(:class:`~kvstrata.connector.client.SidecarClient`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvstrata.sidecar import prefault
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.arena import Arena

__all__ = ["ArenaSlot", "MappedArena", "Populate", "slots_in_arena"]


class Populate(Enum):
    """How a mapping's page table is filled (kvstrata.sidecar.prefault)."""

    NOW = "now"  # before the mapping is used, in the mapping thread
    BACKGROUND = "background"  # on a thread of its own
    OFF = "off"  # never: a client that never copies through the arena

    @classmethod
    def parse(cls, value: Populate | str) -> Populate:
        """``value`` as a member; ValueError naming it and the known modes."""
        for member in cls:
            if value is member or member.value == value:
                return member
        known = ", ".join(m.value for m in cls)
        raise ValueError(f"populate_arena: {value!r} is not one of {known}")


@dataclass(frozen=True, slots=True)
class ArenaSlot:
    """One chunk's place in the arena, held under ``lease_id`` until committed or released."""

    lease_id: int
    offset: int  # byte offset into SidecarClient.arena (a writable memoryview)
    length: int
    dtype: str
    shape: tuple[int, ...]


class MappedArena:
    """The sidecar's shared-memory segment (:meth:`Arena.attach`) and the view
    the connector copies through."""

    def __init__(self, name: str, size: int, populate: Populate) -> None:
        self.arena = Arena.attach(name, size, prefault=populate is Populate.BACKGROUND)
        if populate is Populate.NOW:
            prefault.populate(self.arena.address(), size)
        self.size = size
        # A view of the arena's buffer, handed out and dropped, never
        # released: another thread may be mid-copy on it.
        self.view: memoryview | None = memoryview(self.arena.buffer)

    def close(self) -> None:
        # While a view is still held, the mapping stays valid until it is
        # gone (harmless: slots of an old epoch are void).
        self.view = None
        self.arena.close()


def slots_in_arena(
    slots: Sequence[p.SlotInfo | None], asked: int, arena_size: int
) -> list[ArenaSlot | None]:
    """A reply's slots for ``asked`` keys, padded with None past what one
    request carries; ValueError naming what is wrong when the reply has the
    wrong number of slots or one lies outside the arena."""
    if len(slots) != min(asked, p.MAX_KEYS):
        raise ValueError("wrong number of slots")
    out: list[ArenaSlot | None] = []
    for s in slots:
        if s is None:
            out.append(None)
        elif s.offset + s.length > arena_size:
            raise ValueError(f"slot {s.lease_id} lies outside the arena")
        else:
            out.append(ArenaSlot(s.lease_id, s.offset, s.length, s.dtype, tuple(s.shape)))
    out.extend([None] * (asked - len(out)))
    return out
