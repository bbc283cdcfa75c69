"""A stand-in for a promotion's ``place`` (``Tier.get_into``): it hands out a
buffer of the asked length and records what it was asked, as the engine's
reservation of an L1 slot would."""

from __future__ import annotations

from kvstrata.sidecar.objformat import ChunkMeta


class Destination:
    """``place(nbytes, meta)``: a fresh buffer of ``nbytes`` (pre-filled with
    0xEE, so bytes never written show), or None when ``room`` is False."""

    def __init__(self, room: bool = True) -> None:
        self.room = room
        self.asked: list[tuple[int, ChunkMeta]] = []
        self.buffer = bytearray()

    def __call__(self, nbytes: int, meta: ChunkMeta) -> memoryview | None:
        self.asked.append((nbytes, meta))
        if not self.room:
            return None
        self.buffer = bytearray(b"\xee" * nbytes)
        return memoryview(self.buffer)
