"""Message bodies of the host-mode data ops, and the base every body shares (``docs/protocol.md``).

Each is a slotted dataclass typed as it is after validation: ``to_wire``
gives the body map and ``from_wire`` validates one (raising
:class:`~kvstrata.sidecar.wire.ProtocolError` naming the field), so code
past the boundary reads fields and never re-checks them. Here: the
:class:`Message` base, LOOKUP, PREPARE_STORE / COMMIT_STORE,
PREPARE_RETRIEVE, RELEASE, END_REQUEST, PING, STATS and error replies.
The session's opening (HELLO) is :mod:`kvstrata.sidecar.hello_messages`,
the KV events :mod:`kvstrata.sidecar.event_messages`, the ipc-mode ops
:mod:`kvstrata.sidecar.ipc_messages`; :mod:`kvstrata.sidecar.protocol`
gathers them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, TypeVar

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.tierchoice import TierChoice, read_tiers
from kvstrata.sidecar.wire import (
    COMMIT_STORE,
    E_BAD_REQUEST,
    E_INTERNAL,
    END_REQUEST,
    LOOKUP,
    MAX_GROUPS,
    MAX_STR,
    PING,
    PREPARE_RETRIEVE,
    PREPARE_STORE,
    RELEASE,
    STATS,
    ProtocolError,
    bad_field,
    each_item,
    read_bool,
    read_int,
    read_items,
    read_keys,
    read_list,
    read_runs,
    read_shape,
    read_str,
    required,
)

_T = TypeVar("_T", bound="Message")

MAX_TENANT_NAME = 256  # a tenant name a client may send (the sidecar refuses unknown ones)


def load_tiers_on_wire(body: dict[str, Any], load_tiers: TierChoice) -> dict[str, Any]:
    """``body`` with a request's ``load_tiers`` as the wire has them: left out
    for every tier (what older sidecars read), else a sorted list."""
    if load_tiers is None:
        body.pop("load_tiers", None)
    else:
        body["load_tiers"] = sorted(load_tiers)
    return body


@dataclass(slots=True)
class Message:
    """Base of every body. Subclasses override ``from_wire`` when a field
    needs more than a type check."""

    op: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        # An enum field (a transfer mode) goes on the wire as its value, a string.
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls: type[_T], body: Mapping[str, Any]) -> _T:
        return cls()


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


@dataclass(slots=True)
class SlotInfo:
    """A leased arena range: ``[lease_id, offset, length, dtype, shape]`` on the wire."""

    lease_id: int
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]

    def to_wire(self) -> list[Any]:
        return [self.lease_id, self.offset, self.length, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, value: Any, name: str) -> SlotInfo | None:
        if value is None:
            return None
        items = read_list(value, name, 5)
        if len(items) != 5:
            raise bad_field(name, "[lease_id, offset, length, dtype, shape]", value)
        return cls(
            lease_id=read_int(items[0], f"{name}.lease_id"),
            offset=read_int(items[1], f"{name}.offset"),
            length=read_int(items[2], f"{name}.length"),
            dtype=read_str(items[3], f"{name}.dtype", 32),
            shape=read_shape(items[4], f"{name}.shape"),
        )


def _slots_to_wire(slots: Sequence[SlotInfo | None]) -> list[Any]:
    return [None if s is None else s.to_wire() for s in slots]


def _slots_from_wire(value: Any) -> list[SlotInfo | None]:
    return read_items(value, "slots", SlotInfo.from_wire)


@dataclass(slots=True)
class LookupRequest(Message):
    op: ClassVar[str] = LOOKUP
    keys: list[ChunkKey] = field(default_factory=list)  # chunk keys of the prompt, in order
    prefetch: bool = False  # promote the hit chunks into L1 under leases of owner
    owner: str = ""  # the vLLM request id the prefetch leases belong to
    groups: int = 1  # keys in this many equal runs, one per rank namespace
    # partials[i]: keys of partial chunks that may follow i full chunks,
    # longest first (optional, one namespace only; see kvstrata.sidecar.partials)
    partials: list[list[ChunkKey]] = field(default_factory=list)
    # the tiers this request may load from (kvstrata.sidecar.tierchoice); None: all
    load_tiers: TierChoice = None

    def to_wire(self) -> dict[str, Any]:
        return load_tiers_on_wire(Message.to_wire(self), self.load_tiers)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LookupRequest:
        keys = read_keys(required(body, "keys"))
        groups = read_int(body.get("groups", 1), "groups", 1, MAX_GROUPS)
        if len(keys) % groups:
            raise ProtocolError(
                E_BAD_REQUEST, f"field 'groups': {len(keys)} keys do not split into {groups} runs"
            )
        partials = read_list(body.get("partials", []), "partials")
        if partials and groups > 1:
            raise ProtocolError(
                E_BAD_REQUEST, "field 'partials': only with one namespace (groups 1)"
            )
        return cls(
            keys=keys,
            prefetch=read_bool(required(body, "prefetch"), "prefetch"),
            owner=read_str(required(body, "owner"), "owner"),
            groups=groups,
            partials=each_item(partials, "partials", read_keys),
            load_tiers=read_tiers(body.get("load_tiers"), "load_tiers"),
        )


@dataclass(slots=True)
class LookupReply(Message):
    op: ClassVar[str] = LOOKUP
    hit_chunks: int = 0  # length of the prefix found, in chunks
    tiers: list[str] = field(default_factory=list)  # per hit chunk: the tier it was found in
    partial: int = -1  # index into partials[hit_chunks] of the partial found; -1: none
    partial_tier: str = ""  # tier of the partial chunk found

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LookupReply:
        tiers = read_list(required(body, "tiers"), "tiers")
        partial = body.get("partial", -1)
        return cls(
            hit_chunks=read_int(required(body, "hit_chunks"), "hit_chunks"),
            tiers=each_item(tiers, "tiers", lambda t, n: read_str(t, n, 32)),
            partial=-1 if partial == -1 else read_int(partial, "partial"),
            partial_tier=read_str(body.get("partial_tier", ""), "partial_tier", 32),
        )


@dataclass(slots=True)
class PrepareStoreRequest(Message):
    op: ClassVar[str] = PREPARE_STORE
    keys: list[ChunkKey] = field(default_factory=list)  # chunks to store
    nbytes: int = 0  # bytes of each chunk
    dtype: str = "uint8"  # element type of a chunk, as its slot reports it
    shape: tuple[int, ...] = ()  # shape of a chunk, as its slot reports it
    owner: str = ""  # the request (or step) the write leases belong to
    blocks: int = 0  # 0: full chunks; else partial chunks of this many blocks
    covers: list[ChunkKey] = field(default_factory=list)  # partials these supersede
    tenant: str = ""  # the tenant of the chunks (HELLO's tenants); "": the default tenant
    # the tiers these chunks may be stored into (kvstrata.sidecar.tierchoice); None: all
    store_tiers: TierChoice = None

    def to_wire(self) -> dict[str, Any]:
        body = Message.to_wire(self)
        body["shape"] = list(self.shape)
        if self.store_tiers is None:
            del body["store_tiers"]  # left out: every tier (and what older sidecars read)
        else:
            body["store_tiers"] = sorted(self.store_tiers)
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PrepareStoreRequest:
        return cls(
            keys=read_keys(required(body, "keys")),
            nbytes=read_int(required(body, "nbytes"), "nbytes", 1, 1 << 40),
            dtype=read_str(required(body, "dtype"), "dtype", 16),
            shape=read_shape(required(body, "shape")),
            owner=read_str(required(body, "owner"), "owner"),
            blocks=read_int(body.get("blocks", 0), "blocks", 0, 0xFFFF),
            covers=read_keys(body.get("covers", []), "covers"),
            tenant=read_str(body.get("tenant", ""), "tenant", MAX_TENANT_NAME),
            store_tiers=read_tiers(body.get("store_tiers"), "store_tiers", need_l1=True),
        )


@dataclass(slots=True)
class SlotsReply(Message):
    """Reply of PREPARE_STORE and PREPARE_RETRIEVE: one slot or nil per key."""

    # per key: an arena slot, or nil (store: skip the key; retrieve: a miss)
    slots: list[SlotInfo | None] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"slots": _slots_to_wire(self.slots)}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SlotsReply:
        return cls(slots=_slots_from_wire(required(body, "slots")))


@dataclass(slots=True)
class CommitStoreRequest(Message):
    op: ClassVar[str] = COMMIT_STORE
    lease_ids: list[int] = field(default_factory=list)  # write leases from PREPARE_STORE
    # per lease: true to publish the chunk, false to drop it
    ok: list[bool] = field(default_factory=list)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CommitStoreRequest:
        ids = read_list(required(body, "lease_ids"), "lease_ids")
        oks = read_list(required(body, "ok"), "ok")
        if len(ids) != len(oks):
            raise ProtocolError(
                E_BAD_REQUEST,
                f"fields 'lease_ids' and 'ok' differ in length ({len(ids)}, {len(oks)})",
            )
        return cls(
            lease_ids=each_item(ids, "lease_ids", read_int),
            ok=each_item(oks, "ok", read_bool),
        )


@dataclass(slots=True)
class CommitStoreReply(Message):
    op: ClassVar[str] = COMMIT_STORE
    # per lease id (or key): whether the chunk was published
    committed: list[bool] = field(default_factory=list)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CommitStoreReply:
        return cls(committed=read_items(required(body, "committed"), "committed", read_bool))


@dataclass(slots=True)
class PrepareRetrieveRequest(Message):
    op: ClassVar[str] = PREPARE_RETRIEVE
    keys: list[ChunkKey] = field(default_factory=list)  # chunks to read, in prefix order
    owner: str = ""  # the request the read leases belong to
    runs: list[int] = field(default_factory=list)  # prefix lengths; empty: one run
    blocks: int = 0  # the block count every key must hold (0: full chunks)
    # the tiers below L1 a chunk may be promoted from for this read (as the
    # LOOKUP's load_tiers; kvstrata.sidecar.tierchoice); None: all
    load_tiers: TierChoice = None

    def to_wire(self) -> dict[str, Any]:
        return load_tiers_on_wire(Message.to_wire(self), self.load_tiers)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PrepareRetrieveRequest:
        keys = read_keys(required(body, "keys"))
        return cls(
            keys=keys,
            owner=read_str(required(body, "owner"), "owner"),
            runs=read_runs(body, keys),
            blocks=read_int(body.get("blocks", 0), "blocks", 0, 0xFFFF),
            load_tiers=read_tiers(body.get("load_tiers"), "load_tiers"),
        )


@dataclass(slots=True)
class ReleaseRequest(Message):
    op: ClassVar[str] = RELEASE
    lease_ids: list[int] = field(default_factory=list)  # read leases to end

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ReleaseRequest:
        return cls(lease_ids=read_items(required(body, "lease_ids"), "lease_ids", read_int))


@dataclass(slots=True)
class CountReply(Message):
    """Reply of RELEASE and END_REQUEST: how many leases were dropped."""

    released: int = 0  # leases ended

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CountReply:
        return cls(released=read_int(required(body, "released"), "released"))


@dataclass(slots=True)
class EndRequestRequest(Message):
    op: ClassVar[str] = END_REQUEST
    owner: str = ""  # ends every lease of this owner, prefetches on their way included

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EndRequestRequest:
        return cls(owner=read_str(required(body, "owner"), "owner"))


@dataclass(slots=True)
class PingRequest(Message):
    op: ClassVar[str] = PING


@dataclass(slots=True)
class PingReply(Message):
    op: ClassVar[str] = PING
    server_version: str = ""  # the sidecar's version
    session_valid: bool = False  # whether the request's session is known

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PingReply:
        return cls(
            server_version=read_str(required(body, "server_version"), "server_version"),
            session_valid=read_bool(required(body, "session_valid"), "session_valid"),
        )


@dataclass(slots=True)
class StatsRequest(Message):
    op: ClassVar[str] = STATS


@dataclass(slots=True)
class StatsReply(Message):
    op: ClassVar[str] = STATS
    # the engine's counters, as /status shows them
    stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> StatsReply:
        stats = required(body, "stats")
        if not isinstance(stats, dict):
            raise bad_field("stats", "a map", stats)
        return cls(stats=stats)


@dataclass(slots=True)
class ErrorReply(Message):
    code: str = E_INTERNAL  # one of the error codes below
    message: str = ""  # what was wrong, naming the field

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ErrorReply:
        return cls(
            code=read_str(body.get("code", E_INTERNAL), "code", 64),
            message=read_str(body.get("message", ""), "message", 4 * MAX_STR),
        )
