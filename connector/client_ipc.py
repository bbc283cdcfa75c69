"""The ipc-mode part of :class:`~kvstrata.connector.client.SidecarClient`.

In ipc mode the worker shares its KV tensors once (REGISTER_KV, sent again
after every re-HELLO) and then names block ids only: the sidecar copies
between vLLM's KV and its arena itself (SAVE_BLOCKS, LOAD_BLOCKS). A
sidecar that refuses the registration leaves the client in host mode,
said once and counted as ``ipc_fallback``.

:class:`IpcOps` is held by the client (``client.ipc``). It owns the
registration to resend and why ipc mode is not used; it reaches the sidecar
only through the callables it is given: ``call`` (one request under the
client's deadline, retry and back-off policy), ``count`` (the client's
error counters) and ``bad_reply`` (a reply refused: logged and counted).
When to send the registration (at HELLO, under the client's lock) stays
the client's decision: :meth:`IpcOps.accepted` judges the sidecar's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey

__all__ = ["COPY_MARGIN_S", "REGISTER_TIMEOUT_S", "IpcOps", "sidecar_deadline_ms"]

logger = logging.getLogger("kvstrata.connector.client")

# The first REGISTER_KV on a GPU makes the sidecar page-lock its arena for that
# GPU (it cannot before: it would create a CUDA context on another GPU), seconds
# for tens of GiB. register_kv runs when vLLM registers its KV caches, outside
# any step, so it may wait that long. A resend after a re-HELLO runs inside a
# step under the call deadline: when that passes first, the session stays in
# host mode until the sidecar's answer arrives (IpcOps.awaiting), then turns to
# ipc mode -- a restarted sidecar pins its arena then.
REGISTER_TIMEOUT_S = 120.0

# SAVE_BLOCKS / LOAD_BLOCKS carry the client's deadline (deadline_ms), and the
# sidecar touches no block past it: a client that stopped waiting reports the
# chunks as dropped or missed, and vLLM may hand those blocks to other work at
# once. The sidecar is told to stop this much earlier than the client does
# (at most a fifth of the time left), so that a copy it starts just before
# its deadline, and the answer's way back, end before the client gives up.
COPY_MARGIN_S = 0.1

Call = Callable[[str, p.Message], "p.Message | None"]


def sidecar_deadline_ms(remaining_s: float) -> int:
    """The ``deadline_ms`` to send with ``remaining_s`` left of the call (at
    least 1: 0 would say there is none)."""
    budget = remaining_s - min(COPY_MARGIN_S, max(remaining_s, 0.0) / 5)
    return max(1, int(budget * 1000))


class IpcOps:
    """The client's ipc-mode operations and registration (module docstring)."""

    def __init__(
        self, call: Call, count: Callable[[str], None], bad_reply: Callable[[str, str], None]
    ) -> None:
        self._call = call
        self._count = count
        self._bad_reply = bad_reply
        self.registration: p.RegisterKVRequest | None = None  # resent after every HELLO
        self.fallback_reason = ""  # why ipc mode is not used, once it was refused
        # The request id of a REGISTER_KV of the current session whose call
        # stopped waiting before the sidecar answered (0: none); the client
        # takes that answer when it comes, on any later call.
        self.awaiting = 0
        self._refused_logged = False

    def save_blocks(
        self,
        keys: Sequence[ChunkKey],
        block_ids: Sequence[Sequence[int]],
        after_event: bytes | None,
        owner: str,
        tenant: str = "",
    ) -> list[bool] | None:
        """ipc mode: the sidecar copies these blocks (after ``after_event``) and
        stores them as ``tenant``'s; one bool per key (False: skipped or failed)."""
        body = p.SaveBlocksRequest(
            keys=list(keys),
            block_ids=[[int(b) for b in ids] for ids in block_ids],
            after_event=after_event,
            owner=owner,
            tenant=tenant,
        )
        reply = self._call(p.SAVE_BLOCKS, body)
        if not isinstance(reply, p.CommitStoreReply):
            return None
        committed = list(reply.committed)
        if len(committed) != len(keys):
            self._bad_reply(p.SAVE_BLOCKS, "wrong number of results")
            return None
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
        load_tiers: frozenset[str] | None = None,
    ) -> list[int] | None:
        """As :meth:`load_blocks` for consecutive runs of ``keys`` (``runs``:
        their lengths, one per request of a step) in one call: per run, the
        length of its loaded prefix. The sidecar's copies wait for
        ``after_event`` (an interprocess event's handle) when given; a chunk
        not in L1 is promoted only from ``load_tiers`` (None: every tier)."""
        if sum(runs) != len(keys) or not runs or min(runs) < 1:
            self._count("bad_argument")
            return None
        body = p.LoadBlocksRequest(
            keys=list(keys),
            block_ids=[[int(b) for b in ids] for ids in block_ids],
            owner=owner,
            runs=[int(n) for n in runs],
            after_event=after_event,
            load_tiers=load_tiers,
        )
        reply = self._call(p.LOAD_BLOCKS, body)
        if not isinstance(reply, p.LoadBlocksReply):
            return None
        loaded = list(reply.loaded_runs)
        if len(loaded) != len(runs) or any(got > n for got, n in zip(loaded, runs, strict=True)):
            self._bad_reply(p.LOAD_BLOCKS, "loaded runs do not match the runs asked for")
            return None
        return loaded

    def accepted(self, reply: p.Message | None) -> bool:
        """Whether the sidecar's answer to :attr:`registration` grants ipc mode;
        when it does not, host mode is said once and counted."""
        body = self.registration
        assert body is not None  # the client sends it only when there is one
        if not isinstance(reply, p.RegisterKVReply):
            why = reply.message if isinstance(reply, p.ErrorReply) else "no answer"
            self.fall_back(f"REGISTER_KV refused: {why}")
            return False
        if body.chunk_nbytes and reply.chunk_nbytes != body.chunk_nbytes:
            # The sidecar would store chunks of another size than this worker's
            # layout: its bytes would not be this worker's chunks.
            self.fall_back(
                f"REGISTER_KV: the sidecar plans {reply.chunk_nbytes}-byte chunks, "
                f"this worker {body.chunk_nbytes}"
            )
            return False
        return True

    def late_answer(self, frames: Sequence[bytes]) -> bool:
        """The sidecar's answer to the registration :attr:`awaiting` names,
        arrived on a later call: whether it grants ipc mode (judged as
        :meth:`accepted` does)."""
        self.awaiting = 0
        try:
            reply = p.decode_reply(frames, p.REGISTER_KV)
        except p.ProtocolError as exc:
            self._bad_reply(p.REGISTER_KV, str(exc))
            return False
        if not self.accepted(reply.body):
            return False
        logger.info("kvstrata: the sidecar took the KV registration late; ipc mode from now on")
        return True

    def unavailable(self, why: str) -> None:
        """The worker cannot offer ipc mode: nothing to register, host mode."""
        self.registration = None
        self.fall_back(why)

    def fall_back(self, why: str) -> None:
        """Host mode instead of ipc mode, for ``why``: counted, logged once."""
        self.fallback_reason = why
        self._count("ipc_fallback")
        if not self._refused_logged:
            self._refused_logged = True
            logger.warning("kvstrata: ipc transfer mode unavailable (%s); using host mode", why)
