"""Message bodies of EVENTS: the sidecar's tier changes, read by the connector as vLLM KV events.

Why a module of its own: an EVENTS reply carries records of the sidecar's
journal (:class:`TierEvent`: a key stored in or removed from a tier), a
shape no other op has, with its own limits. Bodies as in
:mod:`kvstrata.sidecar.messages`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.messages import Message
from kvstrata.sidecar.wire import (
    E_BAD_REQUEST,
    EVENTS,
    ProtocolError,
    bad_field,
    read_int,
    read_items,
    read_keys,
    read_list,
    read_str,
    required,
)

__all__ = ["EVENT_KINDS", "MAX_EVENTS", "EventsReply", "EventsRequest", "TierEvent"]

MAX_EVENTS = 4096  # records one EVENTS reply carries
EVENT_KINDS = frozenset({"stored", "removed"})


@dataclass(slots=True)
class EventsRequest(Message):
    """The session's tier changes after sequence number ``after``."""

    op: ClassVar[str] = EVENTS
    after: int = 0  # records after this sequence number (the last reply's next_seq)
    limit: int = MAX_EVENTS  # most records in the reply

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EventsRequest:
        return cls(
            after=read_int(required(body, "after"), "after"),
            limit=read_int(required(body, "limit"), "limit", 1, MAX_EVENTS),
        )


@dataclass(slots=True)
class TierEvent:
    """One record of the sidecar's journal: ``key`` arrived in or left ``tier``."""

    seq: int
    kind: str  # "stored" | "removed"
    tier: str  # "l1", "l2" or the shared tier's name
    key: ChunkKey


def _read_event(value: Any, name: str) -> TierEvent:
    items = read_list(value, name, 4)
    if len(items) != 4:
        raise bad_field(name, "[seq, kind, tier, key]", value)
    kind = read_str(items[1], f"{name}[1]", 16)
    if kind not in EVENT_KINDS:
        raise ProtocolError(E_BAD_REQUEST, f"field '{name}[1]': unknown event kind {kind!r}")
    return TierEvent(
        seq=read_int(items[0], f"{name}[0]"),
        kind=kind,
        tier=read_str(items[2], f"{name}[2]", 32),
        key=read_keys([items[3]], f"{name}[3]")[0],
    )


@dataclass(slots=True)
class EventsReply(Message):
    op: ClassVar[str] = EVENTS
    # [seq, kind, tier, key] records, oldest first
    events: list[TierEvent] = field(default_factory=list)
    next_seq: int = 0  # ask for events after this next time
    lost: int = 0  # records that fell out of the sidecar's ring before this read
    journal_id: int = 0  # changes when the sidecar restarts: numbering starts over

    def to_wire(self) -> dict[str, Any]:
        return {
            "events": [[e.seq, e.kind, e.tier, bytes(e.key)] for e in self.events],
            "next_seq": self.next_seq,
            "lost": self.lost,
            "journal_id": self.journal_id,
        }

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EventsReply:
        return cls(
            events=read_items(required(body, "events"), "events", _read_event, MAX_EVENTS),
            next_seq=read_int(required(body, "next_seq"), "next_seq"),
            lost=read_int(required(body, "lost"), "lost"),
            journal_id=read_int(required(body, "journal_id"), "journal_id"),
        )
