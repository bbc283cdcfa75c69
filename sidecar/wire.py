"""The wire protocol's primitives: versions, op names, error codes, limits
and the field readers every message body is validated with.

Why apart from :mod:`.protocol`: the message bodies (:mod:`.messages`,
:mod:`.ipc_messages`) and the envelopes both build on these; the protocol
itself (frame shapes, the op table) is described in :mod:`.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

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
EVENTS = "EVENTS"
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
E_FORBIDDEN = "forbidden"  # HELLO from a process the sidecar does not admit (server.client_uids)

# The id a client gives each request message, echoed in its reply (not a
# vLLM request id: those travel as ``owner`` strings).
MessageId = int
SessionId = str

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame or body that does not follow the protocol.

    ``code`` is one of the ``E_*`` codes; ``request_id`` is the id read from
    the envelope when it got that far (0 otherwise).
    """

    def __init__(self, code: str, message: str, request_id: MessageId = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


# --------------------------------------------------------------------------
# Field readers: each names the field it refuses.


def bad_field(name: str, what: str, got: Any) -> ProtocolError:
    shown = type(got).__name__ if not isinstance(got, (int, bool, type(None))) else repr(got)
    return ProtocolError(E_BAD_REQUEST, f"field {name!r}: expected {what}, got {shown}")


def required(body: Mapping[str, Any], name: str) -> Any:
    if name not in body:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r} is missing")
    return body[name]


def read_int(value: Any, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, "an integer", value)
    if not lo <= value <= hi:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: {value} is outside [{lo}, {hi}]")
    return value


def read_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad_field(name, "a boolean", value)
    return value


def read_str(value: Any, name: str, max_len: int = MAX_STR) -> str:
    if not isinstance(value, str):
        raise bad_field(name, "a string", value)
    if len(value) > max_len:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: longer than {max_len} characters")
    return value


def read_list(value: Any, name: str, max_len: int = MAX_KEYS) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise bad_field(name, "a list", value)
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
            raise bad_field(f"{name}[{i}]", "bytes", key)
        if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
            raise ProtocolError(
                E_BAD_REQUEST,
                f"field '{name}[{i}]': key of {len(key)} bytes, "
                f"expected {KEY_MIN_BYTES}..{KEY_MAX_BYTES}",
            )
    return [ChunkKey(k) for k in keys]


def read_runs(body: Mapping[str, Any], keys: list[ChunkKey]) -> list[int]:
    """Optional ``runs``: consecutive key counts (one prefix each) covering ``keys``.

    Absent or nil means one run; anything else must be a list (``0``, ``False``,
    ``""`` or ``{}`` are refused by name, not read as "no runs")."""
    raw = body.get("runs")
    runs = [] if raw is None else read_items(raw, "runs", lambda v, n: read_int(v, n, 1))
    if runs and sum(runs) != len(keys):
        raise ProtocolError(E_BAD_REQUEST, f"field 'runs': sums to {sum(runs)}, not {len(keys)}")
    return runs


def read_shape(value: Any, name: str = "shape") -> tuple[int, ...]:
    return tuple(read_items(value, name, read_int, MAX_NDIM))
