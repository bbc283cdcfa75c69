"""The ipc-mode calls of :class:`~kvstrata.connector.client.SidecarClient`.

In ipc mode the worker shares its KV tensors once (REGISTER_KV, sent again
after every re-HELLO) and then names block ids only: the sidecar copies
between vLLM's KV and its arena itself (SAVE_BLOCKS, LOAD_BLOCKS). A
sidecar that refuses the registration leaves the client in host mode,
said once and counted as ``ipc_fallback``.

:class:`IpcOps` is a part of the client (its base class): it uses the
client's lock, call path and counters, and keeps no state of its own but
the registration to resend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey

__all__ = ["IpcOps"]

logger = logging.getLogger("kvstrata.connector.client")

# The first REGISTER_KV on a GPU makes the sidecar page-lock its arena for that
# GPU (it cannot before: it would create a CUDA context on another GPU), seconds
# for tens of GiB. register_kv runs when vLLM registers its KV caches, outside
# any step, so it may wait that long; resends after a re-HELLO keep the call deadline.
REGISTER_TIMEOUT_S = 120.0


class IpcOps:
    """The client's ipc-mode operations (module docstring)."""

    # Provided by the client.
    _lock: threading.Lock
    _connected: bool
    _granted_mode: str
    _kv_registration: p.RegisterKVRequest | None
    _ipc_refused_logged: bool
    call_timeout_s: float
    ipc_fallback_reason: str = ""  # why ipc mode is not used, once it was refused

    def _call(self, op: str, body: p.Message) -> p.Message | None:
        raise NotImplementedError

    def _roundtrip(self, op: str, body: p.Message, deadline: float) -> p.Message | None:
        raise NotImplementedError

    def _count(self, kind: str) -> None:
        raise NotImplementedError

    def _bad_reply(self, op: str, why: str) -> Any:
        raise NotImplementedError

    def register_kv(self, body: p.RegisterKVRequest) -> None:
        """Share the KV tensors for ipc mode: sent now and after every re-HELLO.

        When the sidecar refuses (no GPU it can see, bad handles), the client
        stays in host mode, says why once and counts ``ipc_fallback``.
        """
        with self._lock:
            self._kv_registration = body
            if self._connected and self._granted_mode == "ipc":
                timeout = max(self.call_timeout_s, REGISTER_TIMEOUT_S)
                self._send_registration(time.monotonic() + timeout)

    def save_blocks(
        self,
        keys: Sequence[ChunkKey],
        block_ids: Sequence[Sequence[int]],
        after_event: bytes | None,
        owner: str,
    ) -> list[bool] | None:
        """ipc mode: the sidecar copies these blocks (after ``after_event``) and
        stores them; one bool per key (False: skipped or failed)."""
        body = p.SaveBlocksRequest(
            keys=list(keys),
            block_ids=[[int(b) for b in ids] for ids in block_ids],
            after_event=after_event,
            owner=owner,
        )
        reply = self._call(p.SAVE_BLOCKS, body)
        if not isinstance(reply, p.CommitStoreReply):
            return None
        committed = list(reply.committed)
        if len(committed) != len(keys):
            return self._bad_reply(p.SAVE_BLOCKS, "wrong number of results")
        return committed

    def load_blocks(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[Sequence[int]], owner: str
    ) -> int | None:
        """ipc mode: the sidecar copies the longest stored prefix of ``keys``
        into these blocks; how many chunks it loaded (done when this returns)."""
        loaded = self.load_block_runs(keys, block_ids, owner, [len(keys)])
        return None if loaded is None else loaded[0]

    def load_block_runs(
        self,
        keys: Sequence[ChunkKey],
        block_ids: Sequence[Sequence[int]],
        owner: str,
        runs: Sequence[int],
        after_event: bytes | None = None,
    ) -> list[int] | None:
        """As :meth:`load_blocks` for consecutive runs of ``keys`` (``runs``:
        their lengths, one per request of a step) in one call: per run, the
        length of its loaded prefix. The sidecar's copies wait for
        ``after_event`` (an interprocess event's handle) when given."""
        if sum(runs) != len(keys) or not runs or min(runs) < 1:
            self._count("bad_argument")
            return None
        body = p.LoadBlocksRequest(
            keys=list(keys),
            block_ids=[[int(b) for b in ids] for ids in block_ids],
            owner=owner,
            runs=[int(n) for n in runs],
            after_event=after_event,
        )
        reply = self._call(p.LOAD_BLOCKS, body)
        if not isinstance(reply, p.LoadBlocksReply):
            return None
        loaded = list(reply.loaded_runs)
        if len(loaded) != len(runs) or any(got > n for got, n in zip(loaded, runs, strict=True)):
            return self._bad_reply(p.LOAD_BLOCKS, "loaded runs do not match the runs asked for")
        return loaded

    def _send_registration(self, deadline: float) -> None:
        body = self._kv_registration
        assert body is not None  # callers check
        reply = self._roundtrip(p.REGISTER_KV, body, deadline)
        if not isinstance(reply, p.RegisterKVReply):
            why = reply.message if isinstance(reply, p.ErrorReply) else "no answer"
            self._granted_mode = "host"
            self._ipc_fallback(f"REGISTER_KV refused: {why}")
        elif body.chunk_nbytes and reply.chunk_nbytes != body.chunk_nbytes:
            # The sidecar would store chunks of another size than this worker's
            # layout: its bytes would not be this worker's chunks.
            self._granted_mode = "host"
            self._ipc_fallback(
                f"REGISTER_KV: the sidecar plans {reply.chunk_nbytes}-byte chunks, "
                f"this worker {body.chunk_nbytes}"
            )

    def ipc_unavailable(self, why: str) -> None:
        """The worker cannot offer ipc mode (e.g. its KV has no CUDA IPC handle):
        host mode, said once with ``why`` and counted as ``ipc_fallback``."""
        with self._lock:
            self._kv_registration = None
            self.ipc_fallback_reason = why
            self._ipc_fallback(why)

    def _ipc_fallback(self, why: str) -> None:
        self.ipc_fallback_reason = why
        self._count("ipc_fallback")
        if not self._ipc_refused_logged:
            self._ipc_refused_logged = True
            logger.warning("kvstrata: ipc transfer mode unavailable (%s); using host mode", why)
