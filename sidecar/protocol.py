"""The wire protocol between the vLLM connector and its sidecar.

Why a module of its own: the server (``kvstrata.sidecar.server``) and the
client (``kvstrata.connector.client``) both import it, so the frame shapes
and their validation live in exactly one place: this module (op tables,
envelopes) over :mod:`.wire` (limits, field readers), :mod:`.messages`,
:mod:`.hello_messages`, :mod:`.event_messages` and :mod:`.ipc_messages`
(the bodies), whose names it re-exports.

Transport: ZeroMQ, client DEALER -> server ROUTER. Every message is ONE
ZeroMQ frame holding one msgpack array. A request is::

    [version: int, request_id: int, op: str, session_id: str, body: map]

and its reply::

    [version: int, request_id: int, ok: bool, body: map]

``request_id`` (a :data:`MessageId`, the client's count of its messages) is
echoed so a client can discard late replies to requests it has given up
on. ``session_id`` is what HELLO returned ("" for HELLO; PING
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
of its own (one per request of a step: a miss ends its run only). An error
reply's body is
``{"code": str, "message": str}``; ``message`` names what was wrong.

Ops: the ``REQUESTS`` and ``REPLIES`` tables below name each op's body
dataclasses (:mod:`.messages`, :mod:`.hello_messages`, :mod:`.event_messages`,
:mod:`.ipc_messages`); ``docs/protocol.md`` lists every op with its fields,
the error codes and the limits, generated from those definitions by ``make docs``.

HELLO's reply names the transfer mode granted: a client asking for ``ipc``
gets ``host`` and a ``fallback_reason`` when the sidecar cannot serve it
(no CUDA, another GPU). REGISTER_KV, SAVE_BLOCKS and LOAD_BLOCKS are the ``ipc`` mode: the
worker registers CUDA IPC handles of its KV tensors once per session
(``layers``: ``[handle, offset, shape, strides]`` per layer, ``offset`` in
bytes from the start of the handle's allocation), then moves chunks by
block ids (``block_ids``: one list per key, ``-1`` = skip that block) while
the sidecar runs the copies on the GPU. ``after_event`` is the IPC handle of
a CUDA event the sidecar waits for before reading vLLM's KV (nil: none).

The sidecar records its tiers' changes for EVENTS from the first HELLO with
``kv_events`` true (or the first EVENTS) on: nothing is recorded while no
vLLM publishes events, so the store path pays nothing for them.

A slot on the wire is ``[lease_id, offset, length, dtype, shape]``: a byte
range of the shared L1 arena the client copies KV into (store) or out of
(retrieve) while it holds the lease.

Limits (a request beyond them is refused with ``bad_request`` naming the
field): one frame of at most :data:`MAX_MESSAGE_BYTES`, at most
:data:`MAX_KEYS` keys or lease ids, keys of :data:`KEY_MIN_BYTES` ..
:data:`KEY_MAX_BYTES` bytes, strings of at most :data:`MAX_STR` characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstrata.sidecar.event_messages import (
    MAX_EVENTS,
    EventsReply,
    EventsRequest,
    TierEvent,
)
from kvstrata.sidecar.hello_messages import (
    HelloReply,
    HelloRequest,
    TenantMatchInfo,
)
from kvstrata.sidecar.ipc_messages import (
    IPC_HANDLE_BYTES,
    MAX_BLOCKS_PER_CHUNK,
    MAX_LAYERS,
    KVLayerHandle,
    LoadBlocksReply,
    LoadBlocksRequest,
    RegisterKVReply,
    RegisterKVRequest,
    SaveBlocksRequest,
)
from kvstrata.sidecar.messages import (
    CommitStoreReply,
    CommitStoreRequest,
    CountReply,
    EndRequestRequest,
    ErrorReply,
    LookupReply,
    LookupRequest,
    Message,
    PingReply,
    PingRequest,
    PrepareRetrieveRequest,
    PrepareStoreRequest,
    ReleaseRequest,
    SlotInfo,
    SlotsReply,
    StatsReply,
    StatsRequest,
)
from kvstrata.sidecar.wire import (
    COMMIT_STORE,
    E_BAD_FRAME,
    E_BAD_REQUEST,
    E_BAD_VERSION,
    E_BUSY,
    E_FORBIDDEN,
    E_INTERNAL,
    E_NO_SESSION,
    E_UNKNOWN_OP,
    E_UNSUPPORTED,
    END_REQUEST,
    EVENTS,
    HELLO,
    KEY_MAX_BYTES,
    KEY_MIN_BYTES,
    LOAD_BLOCKS,
    LOOKUP,
    MAX_GROUPS,
    MAX_KEYS,
    MAX_MESSAGE_BYTES,
    MAX_NDIM,
    MAX_STR,
    PING,
    PREPARE_RETRIEVE,
    PREPARE_STORE,
    PROTOCOL_VERSION,
    REGISTER_KV,
    RELEASE,
    SAVE_BLOCKS,
    STATS,
    SUPPORTED_VERSIONS,
    MessageId,
    ProtocolError,
    SessionId,
    bad_field,
    each_item,
    read_bool,
    read_int,
    read_items,
    read_keys,
    read_list,
    read_shape,
    read_str,
    required,
)

__all__ = [
    "COMMIT_STORE",
    "END_REQUEST",
    "EVENTS",
    "E_BAD_FRAME",
    "E_BAD_REQUEST",
    "E_BAD_VERSION",
    "E_BUSY",
    "E_FORBIDDEN",
    "E_INTERNAL",
    "E_NO_SESSION",
    "E_UNKNOWN_OP",
    "E_UNSUPPORTED",
    "HELLO",
    "IPC_HANDLE_BYTES",
    "KEY_MAX_BYTES",
    "KEY_MIN_BYTES",
    "LOAD_BLOCKS",
    "LOOKUP",
    "MAX_BLOCKS_PER_CHUNK",
    "MAX_EVENTS",
    "MAX_GROUPS",
    "MAX_KEYS",
    "MAX_LAYERS",
    "MAX_MESSAGE_BYTES",
    "MAX_NDIM",
    "MAX_STR",
    "PING",
    "PREPARE_RETRIEVE",
    "PREPARE_STORE",
    "PROTOCOL_VERSION",
    "REGISTER_KV",
    "RELEASE",
    "REPLIES",
    "REQUESTS",
    "SAVE_BLOCKS",
    "SESSIONLESS_OPS",
    "STATS",
    "SUPPORTED_VERSIONS",
    "CommitStoreReply",
    "CommitStoreRequest",
    "CountReply",
    "EndRequestRequest",
    "Envelope",
    "ErrorReply",
    "EventsReply",
    "EventsRequest",
    "HelloReply",
    "HelloRequest",
    "KVLayerHandle",
    "LoadBlocksReply",
    "LoadBlocksRequest",
    "LookupReply",
    "LookupRequest",
    "Message",
    "MessageId",
    "PingReply",
    "PingRequest",
    "PrepareRetrieveRequest",
    "PrepareStoreRequest",
    "ProtocolError",
    "RegisterKVReply",
    "RegisterKVRequest",
    "ReleaseRequest",
    "Reply",
    "Request",
    "SaveBlocksRequest",
    "SessionId",
    "SlotInfo",
    "SlotsReply",
    "StatsReply",
    "StatsRequest",
    "TenantMatchInfo",
    "TierEvent",
    "bad_field",
    "decode_body",
    "decode_envelope",
    "decode_reply",
    "decode_request",
    "each_item",
    "encode_error",
    "encode_reply",
    "encode_request",
    "peek_request_id",
    "read_bool",
    "read_int",
    "read_items",
    "read_keys",
    "read_list",
    "read_shape",
    "read_str",
    "required",
]

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
    EVENTS: EventsRequest,
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
    EVENTS: EventsReply,
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
    request_id: MessageId
    op: str
    session_id: SessionId
    body: Message


@dataclass(slots=True)
class Envelope:
    """A request whose envelope is read and checked but whose body is not yet:
    the server checks the session before it pays for the body (which may hold
    thousands of items), and refuses a session-less frame unread."""

    version: int
    request_id: MessageId
    op: str
    session_id: SessionId
    body_reader: msgpack.Unpacker  # fed the whole frame, positioned at the body
    frame_bytes: int


@dataclass(slots=True)
class Reply:
    version: int
    request_id: MessageId
    ok: bool
    body: Message


def _limits(strict: bool) -> dict[str, Any]:
    # Limits that keep a hostile frame from allocating much: msgpack checks
    # each declared length against them before allocating.
    return {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "max_bin_len": KEY_MAX_BYTES if strict else MAX_MESSAGE_BYTES,
        "max_str_len": 4 * MAX_STR if strict else MAX_MESSAGE_BYTES,
        "max_array_len": MAX_KEYS,
        "max_map_len": 64 if strict else 4096,
        "max_ext_len": 0,
    }


def _unpack(data: bytes, strict: bool) -> Any:
    return msgpack.unpackb(data, **_limits(strict))


def _not_msgpack(exc: Exception) -> str:
    detail = str(exc)[:200] or "malformed"
    return f"not a msgpack frame ({type(exc).__name__}: {detail})"


def _envelope(frames: Sequence[bytes], width: int, strict: bool) -> list[Any]:
    if len(frames) != 1:
        raise ProtocolError(E_BAD_FRAME, f"expected 1 frame, got {len(frames)}")
    data = frames[0]
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(E_BAD_FRAME, f"frame of {len(data)} bytes, at most {MAX_MESSAGE_BYTES}")
    try:
        env = _unpack(data, strict)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(E_BAD_FRAME, _not_msgpack(exc)) from None
    if not isinstance(env, list) or len(env) != width:
        raise ProtocolError(E_BAD_FRAME, f"expected a msgpack array of {width} items")
    return env


def encode_request(op: str, request_id: MessageId, session_id: SessionId, body: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, request_id, op, session_id, body.to_wire()])


def decode_envelope(frames: Sequence[bytes]) -> Envelope:
    """Read and check a request's envelope (version, id, op, session) without
    its body: a few small fields, however large the frame. Raises
    :class:`ProtocolError` naming the problem, with the request id once read."""
    if len(frames) != 1:
        raise ProtocolError(E_BAD_FRAME, f"expected 1 frame, got {len(frames)}")
    data = frames[0]
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(E_BAD_FRAME, f"frame of {len(data)} bytes, at most {MAX_MESSAGE_BYTES}")
    unpacker = msgpack.Unpacker(max_buffer_size=MAX_MESSAGE_BYTES, **_limits(strict=True))
    unpacker.feed(data)
    try:
        width = unpacker.read_array_header()
    except Exception as exc:  # msgpack raises several unrelated types
        why = f"expected a msgpack array of 5 items: {_not_msgpack(exc)}"
        raise ProtocolError(E_BAD_FRAME, why) from None
    try:
        head = [unpacker.unpack() for _ in range(4)] if width == 5 else []
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(E_BAD_FRAME, _not_msgpack(exc)) from None
    if width != 5:
        # read_array_header does not apply max_array_len: say it here.
        limit = f" (exceeds max_array_len({MAX_KEYS}))" if width > MAX_KEYS else ""
        raise ProtocolError(E_BAD_FRAME, f"expected a msgpack array of 5 items, got {width}{limit}")
    version, request_id, op, session_id = head
    _check_envelope(version, request_id, op, session_id)
    return Envelope(version, request_id, op, session_id, unpacker, len(data))


def decode_body(envelope: Envelope) -> Request:
    """Read and validate the body of a checked envelope: the per-item work,
    done only for a request the server is going to answer."""
    op, request_id = envelope.op, envelope.request_id
    try:
        body = envelope.body_reader.unpack()
        trailing = envelope.body_reader.tell() != envelope.frame_bytes
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(E_BAD_FRAME, f"{op}: body: {_not_msgpack(exc)}", request_id) from None
    if trailing:
        raise ProtocolError(E_BAD_FRAME, "bytes after the msgpack array", request_id)
    if not isinstance(body, dict):
        raise ProtocolError(E_BAD_REQUEST, f"{op}: body must be a map", request_id)
    try:
        message = REQUESTS[op].from_wire(body)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{op}: {exc}", request_id) from None
    return Request(envelope.version, request_id, op, envelope.session_id, message)


def decode_request(frames: Sequence[bytes]) -> Request:
    """Validate a request frame; raise :class:`ProtocolError` naming the problem."""
    return decode_body(decode_envelope(frames))


def _check_envelope(version: Any, request_id: Any, op: Any, session_id: Any) -> None:
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


def encode_reply(request_id: MessageId, body: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, request_id, True, body.to_wire()])


def encode_error(request_id: MessageId, code: str, message: str) -> bytes:
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


def peek_request_id(frame: bytes) -> MessageId:
    """The request id of a reply frame, or -1 when unreadable (cheap discard check)."""
    try:
        env = _unpack(frame, strict=False)
    except Exception:
        return -1
    if isinstance(env, list) and len(env) >= 2 and isinstance(env[1], int):
        return int(env[1])
    return -1
