"""Message bodies of HELLO: what a client says of itself, and the session the sidecar grants.

Why a module of its own: HELLO opens every session and is the one op whose
fields decide what the rest may do (the namespaces a session may name, the
transfer mode, the tenants and their cache salts, the lease time and the
write budget), so its checks live together. Bodies as in
:mod:`kvstrata.sidecar.messages`: slotted dataclasses typed as they are
after validation, ``from_wire`` raising
:class:`~kvstrata.sidecar.wire.ProtocolError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstrata.sidecar.keys import FINGERPRINT_BYTES
from kvstrata.sidecar.messages import Message
from kvstrata.sidecar.transfer_mode import TransferMode, UnknownMode, parse
from kvstrata.sidecar.wire import (
    E_UNSUPPORTED,
    HELLO,
    MAX_GROUPS,
    ProtocolError,
    bad_field,
    read_bool,
    read_int,
    read_items,
    read_list,
    read_str,
    required,
)

__all__ = ["MAX_TENANTS", "HelloReply", "HelloRequest", "TenantMatchInfo"]

MAX_TENANTS = 64  # tenants in a HELLO reply (the config's limit)
MAX_TENANT_SALTS = 256  # salts or prefixes of one tenant


def _read_mode(body: Mapping[str, Any]) -> TransferMode:
    """HELLO's ``transfer_mode``: a mode this protocol knows, or E_UNSUPPORTED
    naming the value (a newer client may ask for a mode this sidecar lacks)."""
    text = read_str(required(body, "transfer_mode"), "transfer_mode", 16)
    try:
        return parse(TransferMode, text, "field 'transfer_mode'")
    except UnknownMode as exc:
        raise ProtocolError(E_UNSUPPORTED, str(exc)) from None


@dataclass(slots=True)
class HelloRequest(Message):
    op: ClassVar[str] = HELLO
    client_id: str = ""  # the client's own id (one per connector role and rank)
    role: str = "worker"  # "scheduler" or "worker"
    fingerprint: bytes = b""  # namespace fingerprint every key of the session must start with
    # the namespace's fields (informational: the fingerprint is what is checked)
    namespace: dict[str, Any] | None = None
    # the mode asked for: "host" or "ipc" on the wire (another is refused as unsupported)
    transfer_mode: TransferMode = TransferMode.HOST
    pid: int = 0  # process id: logs, /status, which session a re-HELLO replaces
    fingerprints: list[bytes] = field(default_factory=list)  # more namespaces it may name
    kv_events: bool = False  # its vLLM publishes KV events: record the tiers' changes

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> HelloRequest:
        fingerprint = required(body, "fingerprint")
        if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
            raise bad_field("fingerprint", f"{FINGERPRINT_BYTES} bytes", fingerprint)
        namespace = body.get("namespace")
        if namespace is not None and not isinstance(namespace, dict):
            raise bad_field("namespace", "a map", namespace)
        return cls(
            client_id=read_str(required(body, "client_id"), "client_id", 128),
            role=read_str(required(body, "role"), "role", 32),
            fingerprint=fingerprint,
            namespace=namespace,
            transfer_mode=_read_mode(body),
            pid=read_int(body.get("pid", 0), "pid"),
            fingerprints=read_items(
                body.get("fingerprints") or [], "fingerprints", _read_fingerprint, MAX_GROUPS
            ),
            kv_events=read_bool(body.get("kv_events", False), "kv_events"),
        )


def _read_fingerprint(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != FINGERPRINT_BYTES:
        raise bad_field(name, f"{FINGERPRINT_BYTES} bytes", value)
    return value


@dataclass(slots=True)
class HelloReply(Message):
    op: ClassVar[str] = HELLO
    session_id: str = ""  # names the session in every later request
    arena_name: str = ""  # shared-memory segment of L1 to map (/dev/shm/NAME)
    arena_size: int = 0  # bytes of that segment
    chunk_size: int = 0  # the sidecar's tokens per chunk
    server_version: str = ""  # the sidecar's version
    transfer_mode: TransferMode = TransferMode.HOST  # the mode granted: "host" or "ipc"
    lease_seconds: float = 0.0  # a lease not released by then expires
    fallback_reason: str = ""  # why an asked-for mode was not granted
    write_budget: int = 0  # bytes of uncommitted writes a session may hold (0: not said)
    # the tenants of this session's model: [name, cache_salts, cache_salt_prefixes]
    # each; a store names the tenant whose salts match its request's cache_salt
    tenants: list[TenantMatchInfo] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        body = Message.to_wire(self)
        body["tenants"] = [t.to_wire() for t in self.tenants]
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> HelloReply:
        lease = required(body, "lease_seconds")
        if not isinstance(lease, (int, float)) or isinstance(lease, bool):
            raise bad_field("lease_seconds", "a number", lease)
        return cls(
            session_id=read_str(required(body, "session_id"), "session_id"),
            arena_name=read_str(required(body, "arena_name"), "arena_name", 255),
            arena_size=read_int(required(body, "arena_size"), "arena_size"),
            chunk_size=read_int(required(body, "chunk_size"), "chunk_size", 1),
            server_version=read_str(required(body, "server_version"), "server_version"),
            transfer_mode=_read_mode(body),
            lease_seconds=float(lease),
            fallback_reason=read_str(body.get("fallback_reason", ""), "fallback_reason"),
            write_budget=read_int(body.get("write_budget", 0), "write_budget"),
            tenants=read_items(
                body.get("tenants", []), "tenants", TenantMatchInfo.from_wire, MAX_TENANTS
            ),
        )


@dataclass(slots=True)
class TenantMatchInfo:
    """Which requests are one tenant's: ``[name, cache_salts, cache_salt_prefixes]``."""

    name: str
    cache_salts: list[str]
    cache_salt_prefixes: list[str]

    def to_wire(self) -> list[Any]:
        return [self.name, self.cache_salts, self.cache_salt_prefixes]

    @classmethod
    def from_wire(cls, value: Any, name: str) -> TenantMatchInfo:
        items = read_list(value, name, 3)
        if len(items) != 3:
            raise bad_field(name, "[name, cache_salts, cache_salt_prefixes]", value)

        def salts(v: Any, n: str) -> list[str]:
            return read_items(v, n, read_str, MAX_TENANT_SALTS)

        return cls(
            read_str(items[0], f"{name}[0]", 63),
            salts(items[1], f"{name}[1]"),
            salts(items[2], f"{name}[2]"),
        )
