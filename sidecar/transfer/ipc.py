"""IPC transfer mode: the sidecar copies between vLLM's KV and its arena itself.

Why: in host mode every byte crosses the vLLM process (its connector copies
into the shared arena). In ``ipc`` mode the worker shares its KV tensors
once (CUDA IPC memory handles, :data:`~kvstrata.sidecar.protocol.REGISTER_KV`)
and then names only block ids; the sidecar runs the ``csrc`` kernels on
its own stream between the mapped KV and its pinned arena, after the
CUDA event vLLM recorded at the end of its forward pass.

State, one :class:`~kvstrata.sidecar.transfer.ipc_mapping.IpcMapping` per
session (never shared between sessions; what REGISTER_KV checks and plans
before it is installed: :mod:`kvstrata.sidecar.transfer.kv_registration`)::

    session_id -> IpcMapping(device, opened handles, CopyPlan, chunk dtype/shape)
    session_id -> _Registering(count, ended)   while a REGISTER_KV opens handles

A mapping lives exactly as long as its session: the handles are closed
when the session ends for any reason (END, replaced by a new HELLO,
reaped as idle, or its process gone, which the liveness socket reports at
once), so no GPU memory of a dead vLLM stays mapped here. A session that
ends while its REGISTER_KV is still opening handles is marked ended, and
that registration closes what it opened instead of keeping it.

The GPU is reached through a
:class:`~kvstrata.sidecar.transfer.ipc_device.TransferDevice` (the CUDA one is
:class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevice`). Nothing here
imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tierchoice import TierChoice
from kvstrata.sidecar.transfer.ipc_device import STICKY_CUDA_ERRORS, TransferDevice
from kvstrata.sidecar.transfer.ipc_mapping import IpcMapping, past
from kvstrata.sidecar.transfer.kv_registration import open_and_plan

if TYPE_CHECKING:
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.keys import ChunkKey
    from kvstrata.sidecar.leases import Slot

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Registering:
    """REGISTER_KVs of one session in flight, and whether the session ended meanwhile."""

    count: int = 0
    ended: bool = False


class IpcTransfers:
    """The ipc-mode ops against the engine (see the module docstring).

    Thread-safe: the mapping table has its own lock; copies of different
    sessions may run at once.
    """

    def __init__(
        self, engine: StorageManager, open_device: Callable[[str], TransferDevice]
    ) -> None:
        self.engine = engine
        self._open_device = open_device
        self._devices: dict[str, TransferDevice] = {}
        self._mappings: dict[str, IpcMapping] = {}
        # Sessions whose REGISTER_KV is opening handles now -> set once the session
        # ended meanwhile: the registration then closes what it opened, never inserts.
        self._registering: dict[str, _Registering] = {}
        self._lock = threading.Lock()
        self.copy_failures: Counter[str] = Counter()  # op (save, load) -> failed copies
        # op -> copies abandoned at the client's deadline (SAVE_BLOCKS / LOAD_BLOCKS)
        self.expired: Counter[str] = Counter()
        self.fault = ""  # the CUDA fault that broke the GPU context; "" while healthy

    def _device(self, uuid: str) -> TransferDevice:
        """The GPU with this UUID (opened once); OSError when this sidecar cannot see it."""
        with self._lock:
            device = self._devices.get(uuid)
            if device is None:
                device = self._devices[uuid] = self._open_device(uuid)
            return device

    def __len__(self) -> int:
        with self._lock:
            return len(self._mappings)

    def gpu_stats(self) -> dict[str, object]:
        """What the metrics export: copy failures by op, staging fallbacks, the fault."""
        with self._lock:
            devices = list(self._devices.values())
            failures = dict(self.copy_failures)
            expired = dict(self.expired)
        return {
            "copy_failures": failures,
            "expired": expired,
            "staging_fallbacks": sum(int(getattr(d, "fallbacks", 0)) for d in devices),
            "fault": self.fault,
        }

    def _copy_failed(self, op: str, session_id: str, exc: Exception) -> None:
        """Count a failed copy; a sticky CUDA error also marks the GPU context broken."""
        logger.error("GPU %s for session %s failed: %s", op, session_id[:8], exc)
        with self._lock:
            self.copy_failures[op] += 1
            if getattr(exc, "name", "") in STICKY_CUDA_ERRORS and not self.fault:
                self.fault = f"{op}: {exc}"
                logger.critical(
                    "the GPU context is broken (%s): ipc calls are refused, sessions move "
                    "to host mode until the sidecar restarts",
                    exc,
                )

    def _check_healthy(self) -> None:
        if self.fault:
            raise p.ProtocolError(
                p.E_UNSUPPORTED,
                f"the sidecar's GPU context is broken ({self.fault}); use host mode",
            )

    # -- registration ---------------------------------------------------------

    def register(self, session_id: str, body: p.RegisterKVRequest) -> p.RegisterKVReply:
        """Open the worker's handles and plan its copies; replaces an earlier one
        once the new one is complete (a refused registration leaves the one that
        worked in place: the worker's copies keep running on it)."""
        self._check_healthy()
        with self._lock:
            registering = self._registering.setdefault(session_id, _Registering())
            registering.count += 1
        try:
            return self._register(session_id, body, registering)
        finally:
            with self._lock:
                registering.count -= 1
                if registering.count == 0:
                    del self._registering[session_id]

    def _register(
        self, session_id: str, body: p.RegisterKVRequest, registering: _Registering
    ) -> p.RegisterKVReply:
        try:
            device = self._device(body.device_uuid)
        except OSError as exc:
            raise p.ProtocolError(
                p.E_UNSUPPORTED, f"field 'device_uuid': GPU {body.device_uuid!r}: {exc}"
            ) from None
        opened, plan, chunk_nbytes = open_and_plan(device, body, self.engine.arena.size)
        mapping = IpcMapping(
            device=device,
            opened=opened,
            plan=plan,
            blocks_per_chunk=body.blocks_per_chunk,
            # The shape a host-mode worker of the same layout expects: what one pod
            # saves loads in another that shares the tier, whichever mode each runs.
            meta=ChunkMeta(
                dtype=body.dtype, shape=plan.chunk_shape(body.blocks_per_chunk, body.itemsize)
            ),
        )
        self._install(session_id, mapping, registering)
        logger.info(
            "session %s registered %d KV tensors (%d plan layers, chunk %d bytes)",
            session_id[:8],
            len(body.layers),
            plan.num_layers,
            chunk_nbytes,
        )
        return p.RegisterKVReply(layers=len(body.layers), chunk_nbytes=chunk_nbytes)

    def _install(self, session_id: str, mapping: IpcMapping, registering: _Registering) -> None:
        """Make ``mapping`` the session's, closing the one it replaces; refused
        when the session ended while its handles were being opened."""
        with self._lock:
            ended = registering.ended
            old = None if ended else self._mappings.get(session_id)
            if not ended:
                self._mappings[session_id] = mapping
        if ended:
            # close() ran while the handles were being opened and found nothing to
            # close: inserting now would keep them mapped with no session to end them.
            self._release_handles(session_id, mapping)
            raise p.ProtocolError(p.E_BAD_REQUEST, "REGISTER_KV: the session ended meanwhile")
        if old is not None:
            self._close_mapping(session_id, old)

    def close(self, session_id: str) -> bool:
        """Close a session's handles; whether it had any.

        Never waits for the copies already running on them (the liveness
        thread calls this for every dead session, and one wedged copy must
        not keep the others mapped): a handle closed under a running kernel
        is an illegal address, which would break the sidecar's CUDA context
        for every session, so the last of those copies closes the handles
        when it ends. Copies waiting for the peer's event give up at once.
        No new copy can start once the mapping is out of the table.
        """
        with self._lock:
            registering = self._registering.get(session_id)
            if registering is not None:
                registering.ended = True  # its handles are closed by the registration
            mapping = self._mappings.pop(session_id, None)
            if mapping is None:
                return registering is not None
            mapping.closing.set()  # a copy waiting for the dead peer's event stops
        self._close_mapping(session_id, mapping)
        return True

    def _close_mapping(self, session_id: str, mapping: IpcMapping) -> None:
        """Close the handles of a mapping already out of the table now, or, while
        copies run on it, have the last of them do it (see :meth:`close`)."""
        with self._lock:
            mapping.detached = True
            running = mapping.copies
        if running:
            logger.info("session %s: IPC handles close when its %d running copies end",
                        session_id[:8], running)  # fmt: skip
            return
        self._release_handles(session_id, mapping)

    def _release_handles(self, session_id: str, mapping: IpcMapping) -> None:
        for address in mapping.opened:
            try:
                mapping.device.close_memory(address)
            except OSError:
                logger.exception("closing an IPC handle of session %s failed", session_id[:8])
        logger.info("session %s: %d IPC handles closed", session_id[:8], len(mapping.opened))

    @contextlib.contextmanager
    def _using(self, session_id: str) -> Iterator[IpcMapping]:
        """The session's mapping, kept open (not closed under us) while in use."""
        self._check_healthy()
        with self._lock:
            mapping = self._mappings.get(session_id)
            if mapping is None:
                raise p.ProtocolError(p.E_BAD_REQUEST, "no KV registered: send REGISTER_KV first")
            mapping.copies += 1
        try:
            yield mapping
        finally:
            with self._lock:
                mapping.copies -= 1
                last = mapping.copies == 0 and mapping.detached
            if last:  # the session ended while this copy ran
                self._release_handles(session_id, mapping)

    # -- copies ---------------------------------------------------------------

    def save(
        self,
        session_id: str,
        body: p.SaveBlocksRequest,
        owner_key: str,
        expires: float | None = None,
    ) -> p.CommitStoreReply:
        """Reserve arena slots, gather the blocks into them on the GPU, commit;
        nothing is read past ``expires`` (``time.perf_counter()``; the client's
        deadline: a client that gave up may hand the blocks to another request)."""
        with self._using(session_id) as mapping:
            return self._save(mapping, body, owner_key, session_id, expires)

    def _save(
        self,
        mapping: IpcMapping,
        body: p.SaveBlocksRequest,
        owner_key: str,
        session_id: str,
        expires: float | None = None,
    ) -> p.CommitStoreReply:
        keys = body.keys
        blocks = body.block_ids
        mapping.check_blocks(blocks, save=True)
        # The handler checked the tenant against the config before this copy.
        meta = replace(mapping.meta, tenant=body.tenant) if body.tenant else mapping.meta
        slots: list[Slot | None] = [
            self.engine.reserve(key, mapping.chunk_nbytes, meta, owner_key) for key in keys
        ]
        todo = [(i, s) for i, s in enumerate(slots) if s is not None]
        committed = [False] * len(keys)
        if not todo:
            return p.CommitStoreReply(committed=committed)
        ids = [b for i, _ in todo for b in blocks[i]]
        addresses = [mapping.device.arena_address(s.offset) for _, s in todo]
        try:
            mapping.device.gather(
                mapping.plan, ids, addresses, mapping.blocks_per_chunk, body.after_event,
                cancelled=lambda: mapping.closing.is_set() or past(expires),
            )  # fmt: skip
        except Exception as exc:
            if past(expires):  # the wait for vLLM's event outlasted the client's deadline
                self.expired["save"] += 1
            else:
                self._copy_failed("save", session_id, exc)
            for _, slot in todo:
                self.engine.abort(slot)
            return p.CommitStoreReply(committed=committed)
        if mapping.closing.is_set() or past(expires):
            # Past the deadline the blocks read may already be another request's.
            # The session ended while its copy ran (its process died): what the
            # event guarded may be a dead forward pass's unfinished KV.
            for _, slot in todo:
                self.engine.abort(slot)
            return p.CommitStoreReply(committed=committed)
        for i, slot in todo:
            committed[i] = bool(self.engine.commit(slot))
        return p.CommitStoreReply(committed=committed)

    def load(
        self,
        session_id: str,
        body: p.LoadBlocksRequest,
        owner_key: str,
        expires: float | None = None,
    ) -> p.LoadBlocksReply:
        """Lease the longest present prefix of the keys, scatter it on the GPU,
        release; no scatter starts past ``expires`` (as :meth:`save`'s)."""
        with self._using(session_id) as mapping:
            return self._load(mapping, body, owner_key, session_id, expires)

    def _load(
        self,
        mapping: IpcMapping,
        body: p.LoadBlocksRequest,
        owner_key: str,
        session_id: str,
        expires: float | None = None,
    ) -> p.LoadBlocksReply:
        """Every run (one per request of a step) loads its longest present
        prefix; all of them in one scatter."""
        mapping.check_blocks(body.block_ids)
        runs = body.runs or [len(body.keys)]
        slots: list[Slot] = []
        ids: list[int] = []
        per_run: list[int] = []
        start = 0
        for n in runs:
            keys = body.keys[start : start + n]
            got = self._lease_prefix(mapping, keys, owner_key, body.load_tiers)
            slots += got
            ids += [b for blocks in body.block_ids[start : start + len(got)] for b in blocks]
            per_run.append(len(got))
            start += n
        if slots and past(expires):  # the client recomputes these blocks now
            self.expired["load"] += 1
            for slot in slots:
                self.engine.release_lease(slot.lease_id)
            slots, per_run = [], [0] * len(per_run)
        if not slots:
            return p.LoadBlocksReply(loaded=0, loaded_runs=per_run if body.runs else [])
        try:
            addresses = [mapping.device.arena_address(s.offset) for s in slots]
            mapping.device.scatter(
                mapping.plan, ids, addresses, mapping.blocks_per_chunk, body.after_event,
                cancelled=lambda: mapping.closing.is_set() or past(expires),
            )  # fmt: skip
        except Exception as exc:
            if past(expires):  # the wait for vLLM's event outlasted the client's deadline
                self.expired["load"] += 1
            else:
                self._copy_failed("load", session_id, exc)
            per_run = [0] * len(per_run)
        finally:
            # A lease that expired while the copy ran (a peer's event waited on
            # for long) stopped pinning its slot, which may hold another chunk
            # by now: such a load is reported as none, and vLLM recomputes it.
            held = [self.engine.release_lease(slot.lease_id) for slot in slots]
        if not all(held) and any(per_run):
            logger.warning("ipc load outlived its leases (session %s); reported as not loaded",
                           session_id)  # fmt: skip
            per_run = [0] * len(per_run)
        return p.LoadBlocksReply(loaded=sum(per_run), loaded_runs=per_run if body.runs else [])

    def _lease_prefix(
        self, mapping: IpcMapping, keys: list[ChunkKey], owner: str, tiers: TierChoice
    ) -> list[Slot]:
        """Read leases on the longest prefix of ``keys`` stored with this mapping's
        geometry, promoting only from ``tiers`` (the request's load tiers)."""
        slots: list[Slot] = []
        for key in keys:
            slot = self.engine.acquire(key, owner, tiers=tiers)
            if slot is None:
                break
            if slot.length != mapping.chunk_nbytes:  # stored under another geometry
                self.engine.release_lease(slot.lease_id)
                break
            slots.append(slot)
        return slots
