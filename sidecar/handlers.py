"""What the sidecar does for each protocol op.

Why separate from :mod:`.server`: the server owns sockets, threads and
timing; this module owns the meaning of each op against the engine and the
session table. The ops and their fields are listed in ``docs/protocol.md``,
generated from the message definitions.

Contract of :meth:`Handlers.handle`: it is called with a validated request
and the caller's session (None only for HELLO and PING); it returns the
reply body, or raises :class:`~kvstrata.sidecar.protocol.ProtocolError`
for a refusal the client should hear about. It is safe to call from several
threads at once (the engine and the session table are thread-safe).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.counters import as_status
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.sessions import Session, SessionLimit, SessionTable
from kvstrata.sidecar.tenants import TenantRules, UnknownTenantError
from kvstrata.sidecar.transfer_mode import TransferMode

if TYPE_CHECKING:
    from kvstrata.sidecar.config import SidecarConfig
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.leases import Slot
    from kvstrata.sidecar.metrics import ServerMetrics
    from kvstrata.sidecar.transfer.ipc import IpcTransfers

logger = logging.getLogger(__name__)

# Ops answered on the worker pool: they may wait on L2/L3 I/O (promotion
# into L1), which must never stall the server loop. LOOKUP joins them when
# a shared tier is configured (its existence checks are network calls); a
# local lookup is cheaper than the hop to a worker thread. REGISTER_KV too:
# the first one on a GPU page-locks the arena for it (seconds for tens of GiB).
POOLED_OPS = frozenset({p.PREPARE_RETRIEVE, p.SAVE_BLOCKS, p.LOAD_BLOCKS, p.REGISTER_KV})
POOLED_OPS_REMOTE = POOLED_OPS | {p.LOOKUP}


def _slot_info(slot: Slot) -> p.SlotInfo:
    return p.SlotInfo(
        lease_id=slot.lease_id,
        offset=slot.offset,
        length=slot.length,
        dtype=slot.meta.dtype,
        shape=tuple(slot.meta.shape),
    )


def _model_of(namespace: dict[str, Any] | None) -> str:
    """The model a HELLO's namespace names ("" when it names none)."""
    model = (namespace or {}).get("model")
    return model[:256] if isinstance(model, str) else ""


def _own_keys(keys: list[ChunkKey], session: Session) -> list[ChunkKey]:
    """``keys``, each checked to carry the session's namespace fingerprint.

    Tenants are separated by their fingerprints; without this check a client
    could name another namespace's key and read (or overwrite) its chunk.
    """
    fingerprint, more = session.fingerprint, session.more_fingerprints
    n = len(fingerprint)
    for i, key in enumerate(keys):
        if key[:n] != fingerprint and key[:n] not in more:
            raise p.ProtocolError(
                p.E_BAD_REQUEST,
                f"field 'keys[{i}]': the key is not in this session's namespace "
                "(its first 16 bytes must be one of HELLO's fingerprints)",
            )
    return keys


class Handlers:
    """Op implementations (see the module docstring)."""

    def __init__(
        self,
        engine: StorageManager,
        sessions: SessionTable,
        metrics: ServerMetrics,
        config: SidecarConfig,
        server_version: str,
        ipc: IpcTransfers | None = None,
        ipc_unavailable: str = "ipc mode is not enabled",
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.metrics = metrics
        self.config = config
        self.server_version = server_version
        self.ipc = ipc
        self.ipc_unavailable = ipc_unavailable
        # Host mode is always served; ipc while the GPU path is open and sound.
        self.transfer_modes = frozenset(
            {TransferMode.HOST, TransferMode.IPC} if ipc is not None else {TransferMode.HOST}
        )
        self._retire_lock = threading.Lock()
        self.write_budget = int(engine.arena.size * config.server.session_write_fraction)
        self.chunk_limit = int(engine.arena.size * config.server.chunk_max_fraction)
        self.tenants = TenantRules(config.tenants)
        self._table = {
            p.LOOKUP: self._lookup,
            p.PREPARE_STORE: self._prepare_store,
            p.COMMIT_STORE: self._commit_store,
            p.PREPARE_RETRIEVE: self._prepare_retrieve,
            p.RELEASE: self._release,
            p.END_REQUEST: self._end_request,
            p.STATS: self._stats,
            p.EVENTS: self._events,
            p.REGISTER_KV: self._register_kv,
            p.SAVE_BLOCKS: self._save_blocks,
            p.LOAD_BLOCKS: self._load_blocks,
        }

    def handle(
        self,
        request: p.Request,
        session: Session | None,
        identity: bytes,
        received: float | None = None,
        uid: int | None = None,
    ) -> p.Message:
        """The reply body to ``request``; ``received``: when its frame arrived
        (``time.perf_counter()``; None: now), from which a client's
        ``deadline_ms`` counts; ``uid``: the kernel's uid of the peer, where the
        endpoint reports it (read by HELLO only, for its per-uid bound)."""
        if request.op == p.HELLO:
            return self._hello(request.body, identity, uid)
        if request.op == p.PING:
            return self._ping(request.body, session)
        if session is None:  # the server checks this first; keep the contract local too
            raise p.ProtocolError(p.E_NO_SESSION, "say HELLO first", request.request_id)
        # A pooled request may wait its turn while its session ends: check
        # again before any per-item work.
        if not self.sessions.exists(session.session_id):
            raise p.ProtocolError(p.E_NO_SESSION, "the session has ended", request.request_id)
        body = request.body
        if isinstance(body, (p.SaveBlocksRequest, p.LoadBlocksRequest)) and body.deadline_ms:
            # Counted from the frame's arrival: a wait in the pool's queue counts.
            start = time.perf_counter() if received is None else received
            return self._ipc_copy(body, session, start + body.deadline_ms / 1000)
        return self._table[request.op](body, session)

    def reclaim(self, session: Session) -> int:
        """Release every lease of a session that is gone (timed out or replaced)."""
        released = self.engine.release_client(session.session_id)
        if self.ipc is not None:
            self.ipc.close(session.session_id)
        logger.info(
            "client %s (pid %s) gone: %d leases reclaimed", session.client_id, session.pid, released
        )
        return released

    # -- ops ----------------------------------------------------------------

    def _hello(self, body: p.HelloRequest, identity: bytes, uid: int | None) -> p.HelloReply:
        # A client that asks for ipc where it cannot be served gets host mode
        # and the reason (it falls back and says so once); host mode is always
        # served, and a mode the protocol does not know was refused when the
        # body was read (HelloRequest.from_wire).
        mode, fallback = body.transfer_mode, ""
        if mode not in self.transfer_modes:
            mode, fallback = TransferMode.HOST, self.ipc_unavailable
            self.metrics.errors.labels(kind="ipc_fallback").inc()
        try:
            session, replaced = self.sessions.open(
                body.client_id,
                body.role,
                body.pid,
                mode,
                identity,
                body.fingerprint,
                frozenset(body.fingerprints or ()),
                uid=uid,
                model=_model_of(body.namespace),
            )
        except SessionLimit as exc:
            self.metrics.bound_refusals.labels(bound=exc.bound).inc()
            raise p.ProtocolError(p.E_BUSY, str(exc)) from None
        for old in replaced:
            self.reclaim(old)
        if body.kv_events:
            self.engine.record_events()
        logger.info("HELLO from %s (role %s, pid %s)", body.client_id, body.role, body.pid)
        arena = self.engine.arena
        return p.HelloReply(
            session_id=session.session_id,
            arena_name=arena.name,
            arena_size=arena.size,
            chunk_size=self.config.chunk_size,
            server_version=self.server_version,
            transfer_mode=mode,
            lease_seconds=self.config.server.lease_seconds,
            fallback_reason=fallback,
            write_budget=self.write_budget,
            tenants=self._tenants_of(session.model),
        )

    def _tenants_of(self, model: str) -> list[p.TenantMatchInfo]:
        """The tenants a session of ``model`` may name, with the salts that name them."""
        return [
            p.TenantMatchInfo(t.name, t.match.cache_salts, t.match.cache_salt_prefixes)
            for t in self.tenants.by_name.values()
            if not t.match.models or model in t.match.models
        ]

    def _tenant(self, name: str, session: Session) -> str:
        """The checked tenant of a store (a bad_request naming it, counted, else)."""
        try:
            return self.tenants.resolve(name, session.model)
        except UnknownTenantError as exc:
            self.metrics.errors.labels(kind="unknown_tenant").inc()
            raise p.ProtocolError(p.E_BAD_REQUEST, str(exc)) from None

    def _lookup(self, body: p.LookupRequest, session: Session) -> p.LookupReply:
        all_keys = _own_keys(body.keys, session)
        n = len(all_keys) // body.groups
        runs = [all_keys[g * n : (g + 1) * n] for g in range(body.groups)]
        # One run per namespace (rank or KV cache group): a chunk counts when
        # every run holds it.
        load = body.load_tiers
        results = [self.engine.lookup(keys, body.prefetch, load) for keys in runs]
        hit = max(0, min(min(r.hit_chunks for r in results), n))
        tiers = list(results[0].tiers[:hit])
        # A partial chunk after the full prefix (one namespace only; see .partials).
        partial, found = [], None
        if hit < len(body.partials):
            partial = _own_keys(body.partials[hit], session)
            found = self.engine.lookup_partial(partial, load)
        if body.prefetch and (hit or found):
            owner_key = session.owner_key(body.owner)
            for keys in runs:
                self.engine.prefetch(keys[:hit], owner_key, load)
            if found:
                self.engine.prefetch([partial[found[0]]], owner_key, load)
        self.metrics.count_lookup(n, tiers, self.config.chunk_size, results[0].asked)
        if found is None:
            return p.LookupReply(hit_chunks=hit, tiers=tiers)
        return p.LookupReply(hit_chunks=hit, tiers=tiers, partial=found[0], partial_tier=found[1])

    def _prepare_store(self, body: p.PrepareStoreRequest, session: Session) -> p.SlotsReply:
        if not body.dtype.isascii() or not body.dtype:
            raise p.ProtocolError(p.E_BAD_REQUEST, "field 'dtype': expected an ASCII type name")
        if body.nbytes > self.chunk_limit:
            raise p.ProtocolError(
                p.E_BAD_REQUEST,
                f"field 'nbytes': {body.nbytes} exceeds the largest chunk this sidecar takes "
                f"({self.chunk_limit} bytes: server.chunk_max_fraction of the "
                f"{self.engine.arena.size}-byte arena)",
            )
        tenant = self._tenant(body.tenant, session)
        meta = ChunkMeta(body.dtype, tuple(body.shape), body.blocks, tenant)
        if body.covers:  # longer partials and full chunks supersede shorter partials
            self.engine.drop_partials(_own_keys(body.covers, session), replaced=body.blocks > 0)
        owner_key = session.owner_key(body.owner)
        slots: list[p.SlotInfo | None] = []
        over_budget = 0
        deepest: Slot | None = None
        for key in _own_keys(body.keys, session):
            # One session's writes may hold only its share of L1: a client that
            # reserves and never commits (or asks for the whole arena at once)
            # must not evict or starve everyone else. Its expired leases count
            # too: their slots stay pinned until it says it is done. One chunk
            # (at most chunk_limit) is always allowed, so a small arena still
            # takes stores.
            held = self.engine.client_write_bytes(session.session_id)
            if held and held + body.nbytes > self.write_budget:
                over_budget += 1
                slots.append(None)
                continue
            slot = self.engine.reserve(key, body.nbytes, meta, owner_key, None, body.store_tiers)
            slots.append(None if slot is None else _slot_info(slot))
            deepest = slot or deepest
        if body.covers and deepest is not None:
            self.engine.supersede(deepest, _own_keys(body.covers, session))
        if over_budget:
            self.metrics.errors.labels(kind="write_budget").inc(over_budget)
        return p.SlotsReply(slots=slots)

    def _commit_store(self, body: p.CommitStoreRequest, session: Session) -> p.CommitStoreReply:
        # An unknown, expired or another client's lease is not committed.
        client = session.session_id
        committed = [
            self.engine.commit_lease(lease_id, ok, client)
            for lease_id, ok in zip(body.lease_ids, body.ok, strict=True)
        ]
        return p.CommitStoreReply(committed=committed)

    def _prepare_retrieve(self, body: p.PrepareRetrieveRequest, session: Session) -> p.SlotsReply:
        keys = _own_keys(body.keys, session)
        owner_key = session.owner_key(body.owner)
        slots: list[p.SlotInfo | None] = []
        for run in body.runs or [len(keys)]:
            start = len(slots)
            for key in keys[start : start + run]:
                slot = self.engine.acquire(key, owner_key, body.blocks, body.load_tiers)
                if slot is None:
                    # A prefix is only usable up to its first gap: skip the I/O
                    # after it; and a session that ended meanwhile gets nothing more.
                    self._check_alive(session)
                    break
                slots.append(_slot_info(slot))
            slots.extend([None] * (start + run - len(slots)))
        return p.SlotsReply(slots=slots)

    def _check_alive(self, session: Session) -> None:
        """Refuse the rest of a request whose session ended while it ran (the
        engine already gives an ended session no lease; this ends the loop)."""
        if self.engine.client_ended(session.session_id):
            raise p.ProtocolError(p.E_NO_SESSION, "the session ended during the request")

    def _release(self, body: p.ReleaseRequest, session: Session) -> p.CountReply:
        # Releasing a write lease abandons the reservation.
        released = sum(
            self.engine.release_lease(lease_id, session.session_id) for lease_id in body.lease_ids
        )
        return p.CountReply(released=released)

    def _end_request(self, body: p.EndRequestRequest, session: Session) -> p.CountReply:
        released = self.engine.release_owner(session.owner_key(body.owner))
        return p.CountReply(released=int(released))

    # -- ipc mode -------------------------------------------------------------

    def _ipc_session(self, session: Session) -> IpcTransfers:
        if self.ipc is None or session.transfer_mode is not TransferMode.IPC:
            raise p.ProtocolError(
                p.E_UNSUPPORTED, f"this session is in {session.transfer_mode.value} transfer mode"
            )
        return self.ipc

    def _register_kv(self, body: p.RegisterKVRequest, session: Session) -> p.RegisterKVReply:
        try:
            return self._ipc_session(session).register(session.session_id, body)
        finally:
            self._retire_ipc_after_fault()

    def _save_blocks(self, body: p.SaveBlocksRequest, session: Session) -> p.Message:
        return self._ipc_copy(body, session, None)

    def _load_blocks(self, body: p.LoadBlocksRequest, session: Session) -> p.Message:
        return self._ipc_copy(body, session, None)

    def _ipc_copy(
        self,
        body: p.SaveBlocksRequest | p.LoadBlocksRequest,
        session: Session,
        expires: float | None,
    ) -> p.Message:
        """SAVE_BLOCKS / LOAD_BLOCKS; under a client's deadline no block is
        touched past ``expires`` (``time.perf_counter()``; None: no deadline)."""
        ipc = self._ipc_session(session)
        _own_keys(body.keys, session)
        if isinstance(body, p.SaveBlocksRequest):
            self._tenant(body.tenant, session)  # refused before any copy, deadline or not
        owner = session.owner_key(body.owner)
        try:
            if isinstance(body, p.SaveBlocksRequest):
                return ipc.save(session.session_id, body, owner, expires)
            return ipc.load(session.session_id, body, owner, expires)
        finally:
            self._retire_ipc_after_fault()

    def _retire_ipc_after_fault(self) -> None:
        """After a CUDA fault that broke the GPU context (``IpcTransfers.fault``):
        serve host mode only and end every ipc session.

        Why end them: a client's transfer mode changes only at a HELLO, and its
        next call on an ended session answers E_NO_SESSION, upon which it says
        HELLO again and is granted host mode with the fault as the reason. So
        every worker keeps its cache in host mode (the sidecar needs no GPU
        for it) and the pod stays ready: a cache fault costs misses, never
        the pod. The fault stays visible: ``kvstrata_ipc_gpu_faulted``, a
        critical log line and ``/status``'s ``gpu_fault``.
        """
        fault = self.ipc.fault if self.ipc is not None else ""
        if not fault:
            return
        with self._retire_lock:
            if TransferMode.IPC not in self.transfer_modes:
                return
            self.ipc_unavailable = (
                f"the sidecar's GPU context is broken ({fault}); host mode until it restarts"
            )
            self.transfer_modes = frozenset({TransferMode.HOST})
        ended = 0
        for session in self.sessions.sessions():
            if session.transfer_mode is TransferMode.IPC and self.sessions.remove(
                session.session_id
            ):
                self.reclaim(session)
                ended += 1
        logger.critical(
            "GPU fault (%s): ipc mode retired; %d ipc sessions ended, their workers "
            "re-connect in host mode; the sidecar stays ready",
            fault, ended,
        )  # fmt: skip

    def _ping(self, body: p.PingRequest, session: Session | None) -> p.PingReply:
        return p.PingReply(server_version=self.server_version, session_valid=session is not None)

    def _events(self, body: p.EventsRequest, session: Session) -> p.EventsReply:
        """The journal's records of this session's namespace only: another
        tenant's keys are neither shown nor counted."""
        self.engine.record_events()  # a reader from an older client, whose HELLO did not ask
        read = self.engine.journal.read(body.after, body.limit, namespace=session.fingerprint)
        events = [
            p.TierEvent(seq, kind, tier, ChunkKey(key)) for seq, kind, tier, key in read.records
        ]
        return p.EventsReply(
            events=events,
            next_seq=read.next_seq,
            lost=read.lost,
            journal_id=self.engine.journal.journal_id,
        )

    def _stats(self, body: p.StatsRequest, session: Session) -> p.StatsReply:
        return p.StatsReply(stats=self.stats_dict())

    def stats_dict(self) -> dict[str, Any]:
        """Engine stats as plain data (STATS reply and /status)."""
        stats = self.engine.stats()
        return {
            "tiers": {name: asdict(t) for name, t in stats.tiers.items()},
            "counters": as_status(stats.counters, stats.gauges),
            "clients": len(self.sessions),
            "leases_active": stats.gauges.leases_active,
            "pid": os.getpid(),
        }
