"""The wire protocol between the vLLM connector and its sidecar.

Why a module of its own: the server (``kvstrata.sidecar.server``) and the
client (``kvstrata.connector.client``) both import it, so the frame shapes
and their validation live in exactly one place.

Transport: ZeroMQ, client DEALER -> server ROUTER. Every message is ONE
ZeroMQ frame holding one msgpack array. A request is::

    [version: int, request_id: int, op: str, session_id: str, body: map]

and its reply::

    [version: int, request_id: int, ok: bool, body: map]

``request_id`` is echoed so a client can discard late replies to requests
it has given up on. ``session_id`` is what HELLO returned ("" for HELLO; PING
may send "" too); a request naming a session the server does not know (it
restarted, or reaped the client) or one opened by another ZeroMQ peer (a
session belongs to the connection that said HELLO) is answered with the
error code ``no_session`` and the client says HELLO again. Every key a
session names must start with its HELLO ``fingerprint``; any other key is
``bad_request``; HELLO's optional ``fingerprints`` name further namespaces
the session may use (a scheduler's: one per TP/PP rank of its engine), and
LOOKUP's optional ``groups`` splits its keys into that many equal runs, one
per rank namespace, answering the prefix every run holds; PREPARE_RETRIEVE's
optional ``runs`` (lengths summing to the key count) makes each run a prefix
of its own (one per request of a step: a miss ends its run only). An error reply's body is
``{"code": str, "message": str}``; ``message`` names what was wrong.

Ops (body fields; see the dataclasses below for the exact types):

============== ========================================= ==========================================
op             request                                   reply
============== ========================================= ==========================================
HELLO          client_id, role, fingerprint, namespace,  session_id, arena_name, arena_size,
               transfer_mode, pid, [fingerprints]        chunk_size, server_version, transfer_mode,
                                                         lease_seconds
LOOKUP         keys, prefetch, owner, [groups]           hit_chunks, tiers
PREPARE_STORE  keys, nbytes, dtype, shape, owner         slots (one per key, nil = skip the key)
COMMIT_STORE   lease_ids, ok                             committed (one bool per lease id)
PREPARE_RETRIEVE keys, owner, [runs]                     slots (one per key, nil = miss)
RELEASE        lease_ids                                 released
END_REQUEST    owner                                     released
PING           (nothing)                                 server_version, session_valid
STATS          (nothing)                                 stats
REGISTER_KV    device_uuid, kv_cache_layout, block_dim,  layers, chunk_nbytes
               blocks_per_chunk, dtype, layers
SAVE_BLOCKS    keys, block_ids, after_event, owner       committed (one bool per key)
LOAD_BLOCKS    keys, block_ids, owner                    loaded (chunks, a prefix of keys)
============== ========================================= ==========================================

HELLO's reply names the transfer mode granted: a client asking for ``ipc``
gets ``host`` and a ``fallback_reason`` when the sidecar cannot serve it
(no CUDA, another GPU). The last three ops are the ``ipc`` mode: the
worker registers CUDA IPC handles of its KV tensors once per session
(``layers``: ``[handle, offset, shape, strides]`` per layer, ``offset`` in
bytes from the start of the handle's allocation), then moves chunks by
block ids (``block_ids``: one list per key, ``-1`` = skip that block) while
the sidecar runs the copies on the GPU. ``after_event`` is the IPC handle of
a CUDA event the sidecar waits for before reading vLLM's KV (nil: none).

A slot on the wire is ``[lease_id, offset, length, dtype, shape]``: a byte
range of the shared L1 arena the client copies KV into (store) or out of
(retrieve) while it holds the lease.

Limits (a request beyond them is refused with ``bad_request`` naming the
field): one frame of at most :data:`MAX_MESSAGE_BYTES`, at most
:data:`MAX_KEYS` keys or lease ids, keys of :data:`KEY_MIN_BYTES` ..
:data:`KEY_MAX_BYTES` bytes, strings of at most :data:`MAX_STR` characters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from kvstrata.sidecar.keys import FINGERPRINT_BYTES, ChunkKey

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)

MAX_MESSAGE_BYTES = 4 << 20
MAX_KEYS = 8192
MAX_GROUPS = 256  # rank namespaces one session may name (TP x PP)
MAX_STR = 1024
MAX_NDIM = 8
KEY_MIN_BYTES = FINGERPRINT_BYTES + 8
KEY_MAX_BYTES = FINGERPRINT_BYTES + 64

HELLO = "HELLO"
LOOKUP = "LOOKUP"
PREPARE_STORE = "PREPARE_STORE"
COMMIT_STORE = "COMMIT_STORE"
PREPARE_RETRIEVE = "PREPARE_RETRIEVE"
RELEASE = "RELEASE"
END_REQUEST = "END_REQUEST"
PING = "PING"
STATS = "STATS"
REGISTER_KV = "REGISTER_KV"
SAVE_BLOCKS = "SAVE_BLOCKS"
LOAD_BLOCKS = "LOAD_BLOCKS"

# Error codes carried in an error reply's body.
E_BAD_FRAME = "bad_frame"  # not one msgpack array of the envelope shape
E_BAD_VERSION = "unsupported_version"
E_UNKNOWN_OP = "unknown_op"
E_BAD_REQUEST = "bad_request"  # a body field is missing, of the wrong type or too large
E_NO_SESSION = "no_session"
E_UNSUPPORTED = "unsupported"
E_BUSY = "busy"  # the worker pool's backlog is full; retry later (the client treats it as a miss)
E_INTERNAL = "internal"

ReqId = int
SessionId = str

_T = TypeVar("_T", bound="Message")
T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame or body that does not follow the protocol.

    ``code`` is one of the ``E_*`` codes; ``request_id`` is the id read from
    the envelope when it got that far (0 otherwise).
    """

    def __init__(self, code: str, message: str, request_id: ReqId = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


# --------------------------------------------------------------------------
# Field readers: each names the field it refuses.


def _bad(name: str, what: str, got: Any) -> ProtocolError:
    shown = type(got).__name__ if not isinstance(got, (int, bool, type(None))) else repr(got)
    return ProtocolError(E_BAD_REQUEST, f"field {name!r}: expected {what}, got {shown}")


def _get(body: Mapping[str, Any], name: str) -> Any:
    if name not in body:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r} is missing")
    return body[name]


def read_int(value: Any, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if not lo <= value <= hi:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: {value} is outside [{lo}, {hi}]")
    return value


def read_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def read_str(value: Any, name: str, max_len: int = MAX_STR) -> str:
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    if len(value) > max_len:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: longer than {max_len} characters")
    return value


def read_list(value: Any, name: str, max_len: int = MAX_KEYS) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _bad(name, "a list", value)
    if len(value) > max_len:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: {len(value)} items, at most {max_len}")
    return list(value)


def each_item(items: list[Any], name: str, read_item: Callable[[Any, str], T]) -> list[T]:
    """Validate every item of an already-read list, naming ``name[i]`` in errors."""
    return [read_item(v, f"{name}[{i}]") for i, v in enumerate(items)]


def read_items(
    value: Any, name: str, read_item: Callable[[Any, str], T], max_len: int = MAX_KEYS
) -> list[T]:
    """A bounded list whose items are each validated by ``read_item``."""
    return each_item(read_list(value, name, max_len), name, read_item)


def read_keys(value: Any, name: str = "keys") -> list[ChunkKey]:
    keys = read_list(value, name)
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise _bad(f"{name}[{i}]", "bytes", key)
        if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
            raise ProtocolError(
                E_BAD_REQUEST,
                f"field '{name}[{i}]': key of {len(key)} bytes, "
                f"expected {KEY_MIN_BYTES}..{KEY_MAX_BYTES}",
            )
    return [ChunkKey(k) for k in keys]


def read_shape(value: Any, name: str = "shape") -> tuple[int, ...]:
    return tuple(read_items(value, name, read_int, MAX_NDIM))


# --------------------------------------------------------------------------
# Messages. Each is a slotted dataclass; ``to_wire`` gives the body map and
# ``from_wire`` validates one (raising ProtocolError naming the field).


@dataclass(slots=True)
class Message:
    """Base of every body. Subclasses override ``from_wire`` when a field
    needs more than a type check."""

    op: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls: type[_T], body: Mapping[str, Any]) -> _T:
        return cls()


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
            raise _bad(name, "[lease_id, offset, length, dtype, shape]", value)
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
class HelloRequest(Message):
    op: ClassVar[str] = HELLO
    client_id: str = ""
    role: str = "worker"
    fingerprint: bytes = b""
    namespace: dict[str, Any] | None = None
    transfer_mode: str = "host"
    pid: int = 0
    fingerprints: list[bytes] = field(default_factory=list)  # more namespaces it may name

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> HelloRequest:
        fingerprint = _get(body, "fingerprint")
        if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
            raise _bad("fingerprint", f"{FINGERPRINT_BYTES} bytes", fingerprint)
        namespace = body.get("namespace")
        if namespace is not None and not isinstance(namespace, dict):
            raise _bad("namespace", "a map", namespace)
        return cls(
            client_id=read_str(_get(body, "client_id"), "client_id", 128),
            role=read_str(_get(body, "role"), "role", 32),
            fingerprint=fingerprint,
            namespace=namespace,
            transfer_mode=read_str(_get(body, "transfer_mode"), "transfer_mode", 16),
            pid=read_int(body.get("pid", 0), "pid"),
            fingerprints=read_items(
                body.get("fingerprints") or [], "fingerprints", _read_fingerprint, MAX_GROUPS
            ),
        )


def _read_fingerprint(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != FINGERPRINT_BYTES:
        raise _bad(name, f"{FINGERPRINT_BYTES} bytes", value)
    return value


@dataclass(slots=True)
class HelloReply(Message):
    op: ClassVar[str] = HELLO
    session_id: str = ""
    arena_name: str = ""
    arena_size: int = 0
    chunk_size: int = 0
    server_version: str = ""
    transfer_mode: str = "host"
    lease_seconds: float = 0.0
    fallback_reason: str = ""  # why an asked-for mode was not granted
    write_budget: int = 0  # bytes of uncommitted writes a session may hold (0: not said)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> HelloReply:
        lease = _get(body, "lease_seconds")
        if not isinstance(lease, (int, float)) or isinstance(lease, bool):
            raise _bad("lease_seconds", "a number", lease)
        return cls(
            session_id=read_str(_get(body, "session_id"), "session_id"),
            arena_name=read_str(_get(body, "arena_name"), "arena_name", 255),
            arena_size=read_int(_get(body, "arena_size"), "arena_size"),
            chunk_size=read_int(_get(body, "chunk_size"), "chunk_size", 1),
            server_version=read_str(_get(body, "server_version"), "server_version"),
            transfer_mode=read_str(_get(body, "transfer_mode"), "transfer_mode", 16),
            lease_seconds=float(lease),
            fallback_reason=read_str(body.get("fallback_reason", ""), "fallback_reason"),
            write_budget=read_int(body.get("write_budget", 0), "write_budget"),
        )


@dataclass(slots=True)
class LookupRequest(Message):
    op: ClassVar[str] = LOOKUP
    keys: list[ChunkKey] | None = None
    prefetch: bool = False
    owner: str = ""
    groups: int = 1  # keys in this many equal runs, one per rank namespace

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LookupRequest:
        keys = read_keys(_get(body, "keys"))
        groups = read_int(body.get("groups", 1), "groups", 1, MAX_GROUPS)
        if len(keys) % groups:
            raise ProtocolError(
                E_BAD_REQUEST, f"field 'groups': {len(keys)} keys do not split into {groups} runs"
            )
        return cls(
            keys=keys,
            prefetch=read_bool(_get(body, "prefetch"), "prefetch"),
            owner=read_str(_get(body, "owner"), "owner"),
            groups=groups,
        )


@dataclass(slots=True)
class LookupReply(Message):
    op: ClassVar[str] = LOOKUP
    hit_chunks: int = 0
    tiers: list[str] | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LookupReply:
        tiers = read_list(_get(body, "tiers"), "tiers")
        return cls(
            hit_chunks=read_int(_get(body, "hit_chunks"), "hit_chunks"),
            tiers=each_item(tiers, "tiers", lambda t, n: read_str(t, n, 32)),
        )


@dataclass(slots=True)
class PrepareStoreRequest(Message):
    op: ClassVar[str] = PREPARE_STORE
    keys: list[ChunkKey] | None = None
    nbytes: int = 0
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    owner: str = ""

    def to_wire(self) -> dict[str, Any]:
        body = Message.to_wire(self)
        body["shape"] = list(self.shape)
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PrepareStoreRequest:
        return cls(
            keys=read_keys(_get(body, "keys")),
            nbytes=read_int(_get(body, "nbytes"), "nbytes", 1, 1 << 40),
            dtype=read_str(_get(body, "dtype"), "dtype", 16),
            shape=read_shape(_get(body, "shape")),
            owner=read_str(_get(body, "owner"), "owner"),
        )


@dataclass(slots=True)
class SlotsReply(Message):
    """Reply of PREPARE_STORE and PREPARE_RETRIEVE: one slot or nil per key."""

    slots: list[SlotInfo | None] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"slots": _slots_to_wire(self.slots or [])}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SlotsReply:
        return cls(slots=_slots_from_wire(_get(body, "slots")))


@dataclass(slots=True)
class CommitStoreRequest(Message):
    op: ClassVar[str] = COMMIT_STORE
    lease_ids: list[int] | None = None
    ok: list[bool] | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CommitStoreRequest:
        ids = read_list(_get(body, "lease_ids"), "lease_ids")
        oks = read_list(_get(body, "ok"), "ok")
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
    committed: list[bool] | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CommitStoreReply:
        return cls(committed=read_items(_get(body, "committed"), "committed", read_bool))


@dataclass(slots=True)
class PrepareRetrieveRequest(Message):
    op: ClassVar[str] = PREPARE_RETRIEVE
    keys: list[ChunkKey] | None = None
    owner: str = ""
    runs: list[int] = field(default_factory=list)  # prefix lengths; empty: one run

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PrepareRetrieveRequest:
        keys = read_keys(_get(body, "keys"))
        runs = read_items(body.get("runs") or [], "runs", lambda v, n: read_int(v, n, 1))
        if runs and sum(runs) != len(keys):
            raise ProtocolError(
                E_BAD_REQUEST, f"field 'runs': sums to {sum(runs)}, not {len(keys)}"
            )
        return cls(keys=keys, owner=read_str(_get(body, "owner"), "owner"), runs=runs)


@dataclass(slots=True)
class ReleaseRequest(Message):
    op: ClassVar[str] = RELEASE
    lease_ids: list[int] | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ReleaseRequest:
        return cls(lease_ids=read_items(_get(body, "lease_ids"), "lease_ids", read_int))


@dataclass(slots=True)
class CountReply(Message):
    """Reply of RELEASE and END_REQUEST: how many leases were dropped."""

    released: int = 0

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CountReply:
        return cls(released=read_int(_get(body, "released"), "released"))


@dataclass(slots=True)
class EndRequestRequest(Message):
    op: ClassVar[str] = END_REQUEST
    owner: str = ""

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EndRequestRequest:
        return cls(owner=read_str(_get(body, "owner"), "owner"))


@dataclass(slots=True)
class PingRequest(Message):
    op: ClassVar[str] = PING


@dataclass(slots=True)
class PingReply(Message):
    op: ClassVar[str] = PING
    server_version: str = ""
    session_valid: bool = False

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PingReply:
        return cls(
            server_version=read_str(_get(body, "server_version"), "server_version"),
            session_valid=read_bool(_get(body, "session_valid"), "session_valid"),
        )


@dataclass(slots=True)
class StatsRequest(Message):
    op: ClassVar[str] = STATS


@dataclass(slots=True)
class StatsReply(Message):
    op: ClassVar[str] = STATS
    stats: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> StatsReply:
        stats = _get(body, "stats")
        if not isinstance(stats, dict):
            raise _bad("stats", "a map", stats)
        return cls(stats=stats)


@dataclass(slots=True)
class ErrorReply(Message):
    code: str = E_INTERNAL
    message: str = ""

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ErrorReply:
        return cls(
            code=read_str(body.get("code", E_INTERNAL), "code", 64),
            message=read_str(body.get("message", ""), "message", 4 * MAX_STR),
        )


# -- ipc mode -----------------------------------------------------------------

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
MAX_LAYERS = 1024
MAX_BLOCKS_PER_CHUNK = 4096


def _read_handle(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != IPC_HANDLE_BYTES:
        raise _bad(name, f"{IPC_HANDLE_BYTES} bytes (a CUDA IPC handle)", value)
    return value


@dataclass(slots=True)
class KVLayerHandle:
    """One KV tensor shared by CUDA IPC: ``[handle, offset, shape, strides]`` on the wire."""

    handle: bytes
    offset: int  # bytes from the start of the handle's allocation to element 0
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements

    def to_wire(self) -> list[Any]:
        return [self.handle, self.offset, list(self.shape), list(self.strides)]

    @classmethod
    def from_wire(cls, value: Any, name: str) -> KVLayerHandle:
        items = read_list(value, name, 4)
        if len(items) != 4:
            raise _bad(name, "[handle, offset, shape, strides]", value)
        shape = read_shape(items[2], f"{name}.shape")
        strides = read_shape(items[3], f"{name}.strides")
        if len(shape) != len(strides) or not shape:
            raise ProtocolError(E_BAD_REQUEST, f"field '{name}': shape and strides differ")
        return cls(
            handle=_read_handle(items[0], f"{name}.handle"),
            offset=read_int(items[1], f"{name}.offset"),
            shape=shape,
            strides=strides,
        )


@dataclass(slots=True)
class RegisterKVRequest(Message):
    op: ClassVar[str] = REGISTER_KV
    device_uuid: str = ""
    kv_cache_layout: str = ""
    block_dim: int = 0
    blocks_per_chunk: int = 1
    dtype: str = ""
    itemsize: int = 1
    layers: list[KVLayerHandle] | None = None

    def to_wire(self) -> dict[str, Any]:
        body = Message.to_wire(self)
        body["layers"] = [layer.to_wire() for layer in self.layers or []]
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RegisterKVRequest:
        layers = read_items(_get(body, "layers"), "layers", KVLayerHandle.from_wire, MAX_LAYERS)
        if not layers:
            raise ProtocolError(E_BAD_REQUEST, "field 'layers': no KV tensor")
        return cls(
            device_uuid=read_str(_get(body, "device_uuid"), "device_uuid", 64),
            kv_cache_layout=read_str(_get(body, "kv_cache_layout"), "kv_cache_layout", 16),
            block_dim=read_int(_get(body, "block_dim"), "block_dim", 0, MAX_NDIM - 1),
            blocks_per_chunk=read_int(
                _get(body, "blocks_per_chunk"), "blocks_per_chunk", 1, MAX_BLOCKS_PER_CHUNK
            ),
            dtype=read_str(_get(body, "dtype"), "dtype", 32),
            itemsize=read_int(_get(body, "itemsize"), "itemsize", 1, 16),
            layers=layers,
        )


@dataclass(slots=True)
class RegisterKVReply(Message):
    op: ClassVar[str] = REGISTER_KV
    layers: int = 0
    chunk_nbytes: int = 0

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RegisterKVReply:
        return cls(
            layers=read_int(_get(body, "layers"), "layers"),
            chunk_nbytes=read_int(_get(body, "chunk_nbytes"), "chunk_nbytes"),
        )


def _read_block_ids(value: Any, name: str) -> list[int]:
    return read_items(value, name, lambda v, n: read_int(v, n, -1, (1 << 62)), MAX_BLOCKS_PER_CHUNK)


def _read_blocks(body: Mapping[str, Any], keys: list[ChunkKey]) -> list[list[int]]:
    blocks = read_items(_get(body, "block_ids"), "block_ids", _read_block_ids)
    if len(blocks) != len(keys):
        raise ProtocolError(
            E_BAD_REQUEST,
            f"fields 'keys' and 'block_ids' differ in length ({len(keys)}, {len(blocks)})",
        )
    return blocks


@dataclass(slots=True)
class SaveBlocksRequest(Message):
    op: ClassVar[str] = SAVE_BLOCKS
    keys: list[ChunkKey] | None = None
    block_ids: list[list[int]] | None = None
    after_event: bytes | None = None
    owner: str = ""

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SaveBlocksRequest:
        keys = read_keys(_get(body, "keys"))
        event = body.get("after_event")
        return cls(
            keys=keys,
            block_ids=_read_blocks(body, keys),
            after_event=None if event is None else _read_handle(event, "after_event"),
            owner=read_str(_get(body, "owner"), "owner"),
        )


@dataclass(slots=True)
class LoadBlocksRequest(Message):
    op: ClassVar[str] = LOAD_BLOCKS
    keys: list[ChunkKey] | None = None
    block_ids: list[list[int]] | None = None
    owner: str = ""

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LoadBlocksRequest:
        keys = read_keys(_get(body, "keys"))
        return cls(
            keys=keys,
            block_ids=_read_blocks(body, keys),
            owner=read_str(_get(body, "owner"), "owner"),
        )


@dataclass(slots=True)
class LoadBlocksReply(Message):
    op: ClassVar[str] = LOAD_BLOCKS
    loaded: int = 0

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LoadBlocksReply:
        return cls(loaded=read_int(_get(body, "loaded"), "loaded"))


# Request body class of every op the server answers.
REQUESTS: dict[str, type[Message]] = {
    HELLO: HelloRequest,
    LOOKUP: LookupRequest,
    PREPARE_STORE: PrepareStoreRequest,
    COMMIT_STORE: CommitStoreRequest,
    PREPARE_RETRIEVE: PrepareRetrieveRequest,
    RELEASE: ReleaseRequest,
    END_REQUEST: EndRequestRequest,
    PING: PingRequest,
    STATS: StatsRequest,
    REGISTER_KV: RegisterKVRequest,
    SAVE_BLOCKS: SaveBlocksRequest,
    LOAD_BLOCKS: LoadBlocksRequest,
}

# Reply body class of every op (what the client validates).
REPLIES: dict[str, type[Message]] = {
    HELLO: HelloReply,
    LOOKUP: LookupReply,
    PREPARE_STORE: SlotsReply,
    COMMIT_STORE: CommitStoreReply,
    PREPARE_RETRIEVE: SlotsReply,
    RELEASE: CountReply,
    END_REQUEST: CountReply,
    PING: PingReply,
    STATS: StatsReply,
    REGISTER_KV: RegisterKVReply,
    SAVE_BLOCKS: CommitStoreReply,
    LOAD_BLOCKS: LoadBlocksReply,
}

# Ops a client may send without a session.
SESSIONLESS_OPS = frozenset({HELLO, PING})


# --------------------------------------------------------------------------
# Envelopes.


@dataclass(slots=True)
class Request:
    version: int
    request_id: ReqId
    op: str
    session_id: SessionId
    body: Message


@dataclass(slots=True)
class Reply:
    version: int
    request_id: ReqId
    ok: bool
    body: Message


def _unpack(data: bytes, strict: bool) -> Any:
    # Limits that keep a hostile frame from allocating much: msgpack checks
    # each declared length against them before allocating.
    limit_map = 64 if strict else 4096
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_bin_len=KEY_MAX_BYTES if strict else MAX_MESSAGE_BYTES,
        max_str_len=4 * MAX_STR if strict else MAX_MESSAGE_BYTES,
        max_array_len=MAX_KEYS,
        max_map_len=limit_map,
        max_ext_len=0,
    )


def _envelope(frames: Sequence[bytes], width: int, strict: bool) -> list[Any]:
    if len(frames) != 1:
        raise ProtocolError(E_BAD_FRAME, f"expected 1 frame, got {len(frames)}")
    data = frames[0]
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(E_BAD_FRAME, f"frame of {len(data)} bytes, at most {MAX_MESSAGE_BYTES}")
    try:
        env = _unpack(data, strict)
    except Exception as exc:  # msgpack raises several unrelated types
        detail = str(exc)[:200] or "malformed"
        raise ProtocolError(
            E_BAD_FRAME, f"not a msgpack frame ({type(exc).__name__}: {detail})"
        ) from None
    if not isinstance(env, list) or len(env) != width:
        raise ProtocolError(E_BAD_FRAME, f"expected a msgpack array of {width} items")
    return env


def encode_request(op: str, request_id: ReqId, session_id: SessionId, body: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, request_id, op, session_id, body.to_wire()])


def decode_request(frames: Sequence[bytes]) -> Request:
    """Validate a request frame; raise :class:`ProtocolError` naming the problem."""
    version, request_id, op, session_id, body = _envelope(frames, 5, strict=True)
    if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
        raise ProtocolError(E_BAD_FRAME, "request_id must be a non-negative integer")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            E_BAD_VERSION,
            f"protocol version {version!r} is not supported (supported: {SUPPORTED_VERSIONS})",
            request_id,
        )
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(E_UNKNOWN_OP, f"unknown op {op!r}", request_id)
    if not isinstance(session_id, str) or len(session_id) > 64:
        raise ProtocolError(E_BAD_FRAME, "session_id must be a short string", request_id)
    if not isinstance(body, dict):
        raise ProtocolError(E_BAD_REQUEST, f"{op}: body must be a map", request_id)
    try:
        message = REQUESTS[op].from_wire(body)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{op}: {exc}", request_id) from None
    return Request(version, request_id, op, session_id, message)


def encode_reply(request_id: ReqId, body: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, request_id, True, body.to_wire()])


def encode_error(request_id: ReqId, code: str, message: str) -> bytes:
    body = {"code": code, "message": message[: 4 * MAX_STR]}
    return msgpack.packb([PROTOCOL_VERSION, request_id, False, body])


def decode_reply(frames: Sequence[bytes], op: str) -> Reply:
    """Validate a reply to ``op``; an error reply decodes to :class:`ErrorReply`."""
    version, request_id, ok, body = _envelope(frames, 4, strict=False)
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        raise ProtocolError(E_BAD_FRAME, "reply request_id must be an integer")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(E_BAD_VERSION, f"reply version {version!r}", request_id)
    if not isinstance(body, dict) or not isinstance(ok, bool):
        raise ProtocolError(E_BAD_FRAME, "reply must carry a bool and a map", request_id)
    try:
        message = (REPLIES[op] if ok else ErrorReply).from_wire(body)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, str(exc), request_id) from None
    return Reply(version, request_id, ok, message)


def peek_request_id(frame: bytes) -> ReqId:
    """The request id of a reply frame, or -1 when unreadable (cheap discard check)."""
    try:
        env = _unpack(frame, strict=False)
    except Exception:
        return -1
    if isinstance(env, list) and len(env) >= 2 and isinstance(env[1], int):
        return int(env[1])
    return -1
