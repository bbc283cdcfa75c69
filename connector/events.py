"""KV events for routers: what the sidecar's tiers hold, in vLLM's own event format.

Why: prefix-aware routers (llm-d, Dynamo, AIBrix) learn where a prefix is
cached from vLLM's KV events; without ours they score a chunk kvstrata holds
in CPU memory, on disk or in Valkey as a miss. The scheduler role hands
these events to vLLM through ``take_events``, so vLLM's own publisher
(``--kv-events-config``, ZeroMQ) carries them beside its GPU blocks':

============== ============ ==========
tier           ``medium``   ``locality``
============== ============ ==========
L1 (arena)     ``CPU``      ``LOCAL``
L2 (disk)      ``STORAGE``  ``LOCAL``
shared tier    ``STORAGE``  ``REMOTE``
============== ============ ==========

Each event is self-describing as vLLM's are: the chunk's block hashes (equal
to vLLM's own for the same tokens, converted as vLLM converts them), the
parent block's hash, the token ids and the block size. ``ownership`` names
the kvstrata tier (``kvstrata/l1`` ...).

How: the sidecar journals every chunk that arrives in or leaves a tier
(:mod:`kvstrata.sidecar.journal`); a daemon thread here reads that journal
over its own sidecar session (so a slow sidecar never holds the scheduler's
client) and turns records into events. The sidecar only knows chunk keys;
the token ids and hashes come from what the scheduler saw: every chunk it
plans to save or finds in a lookup is described here first (a bounded
registry). A record of a chunk this process never described (stored before
it started) has no tokens to describe it and is skipped, counted.

A restarted sidecar (a new ``journal_id``) has lost its L1: the arena is
process memory. L2's files and the shared tier's objects survive it. So on
a new journal the feed says ``BlockRemoved`` (medium ``CPU``) for every
chunk it announced in L1 and has not seen leave, and nothing for the other
tiers. Not ``AllBlocksCleared``: that event carries no medium (see
``vllm/distributed/kv_events.py``), and these events travel through vLLM's
own publisher beside its GPU blocks', so a router would drop the pod's GPU
blocks and its disk and remote chunks with it, all of which are still there.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import chunk_keys_from_block_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvstrata.connector.client import SidecarClient

__all__ = ["ChunkRegistry", "KVEventFeed", "tier_medium"]

logger = logging.getLogger(__name__)

MAX_DESCRIBED_CHUNKS = 16384  # ~1.5 KiB each at 256 tokens: tens of MiB at most
POLL_INTERVAL_S = 0.1  # while the journal has nothing new
MAX_PENDING_EVENTS = 100_000  # events not yet taken by vLLM; older ones are dropped
TIER_OWNERSHIP = "kvstrata/{tier}"


def tier_medium(tier: str) -> tuple[str, str]:
    """(medium, locality) of a kvstrata tier, in vLLM's words."""
    if tier == "l1":
        return "CPU", "LOCAL"
    if tier == "l2":
        return "STORAGE", "LOCAL"
    return "STORAGE", "REMOTE"


@dataclass(frozen=True, slots=True)
class ChunkDescription:
    """What an event needs to say of one chunk."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: array  # array('l'): compact, for many chunks
    lora_id: int | None
    lora_name: str | None


class ChunkRegistry:
    """Chunk key -> description, least recently described dropped first. Thread-safe."""

    def __init__(self, capacity: int = MAX_DESCRIBED_CHUNKS) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[bytes, ChunkDescription] = OrderedDict()
        self._lock = threading.Lock()

    def describe(
        self, request: Request, fingerprint: bytes, chunks: range, block_size: int, bpc: int
    ) -> None:
        """Describe ``request``'s chunks ``chunks`` (indices) under ``fingerprint``."""
        if not chunks:
            return
        hashes = request.block_hashes
        keys = chunk_keys_from_block_hashes(fingerprint, hashes[: chunks.stop * bpc], bpc)
        with self._lock:  # a waiting request is looked up every step: describe once
            todo = [c for c in chunks if bytes(keys[c]) not in self._entries]
            for c in chunks:
                if bytes(keys[c]) in self._entries:
                    self._entries.move_to_end(bytes(keys[c]))
        if not todo:
            return
        lora = getattr(request, "lora_request", None)
        tokens = request.all_token_ids
        chunk_tokens = block_size * bpc
        made = []
        for c in todo:
            first = c * bpc
            made.append(
                (
                    bytes(keys[c]),
                    ChunkDescription(
                        block_hashes=tuple(bytes(h) for h in hashes[first : first + bpc]),
                        parent_hash=bytes(hashes[first - 1]) if first else None,
                        token_ids=array("l", tokens[c * chunk_tokens : (c + 1) * chunk_tokens]),
                        lora_id=lora.adapter_id if lora is not None else None,
                        lora_name=lora.name if lora is not None else None,
                    ),
                )
            )
        with self._lock:
            for key, description in made:
                self._entries[key] = description
                self._entries.move_to_end(key)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def get(self, key: bytes) -> ChunkDescription | None:
        with self._lock:
            return self._entries.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class KVEventFeed:
    """The sidecar's journal as vLLM ``BlockStored`` / ``BlockRemoved`` events.

    ``take_events`` never waits on the sidecar: the journal is read by a
    daemon thread over ``client`` (its own session), and events wait in a
    bounded list until vLLM's scheduler takes them once per step.
    """

    def __init__(
        self,
        client: SidecarClient,
        block_size: int,
        registry: ChunkRegistry | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.registry = registry or ChunkRegistry()
        self.poll_interval_s = poll_interval_s
        self.undescribed_total = 0  # records of chunks this process never described
        self.lost_total = 0  # records the sidecar's ring dropped before we read them
        self.dropped_total = 0  # events vLLM did not take in time (MAX_PENDING_EVENTS)
        self._classes = _vllm_event_classes()
        self._after = 0
        self._journal_id: int | None = None
        # Chunks announced stored in L1 and not removed since: key -> their
        # blocks' hashes (vLLM's form), what a restart's BlockRemoved names.
        self._in_l1: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._pending: list[Any] = []
        self._lock = threading.Lock()  # guards _pending (take_events runs on vLLM's thread)
        # One poll at a time: a poll reads the cursor, asks the sidecar from
        # it and appends what came back. Two polls at once would read the same
        # cursor and append the same records twice (poll_once is public: a
        # caller may poll beside the reader thread).
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-events", daemon=True)
        self._thread.start()

    def take_events(self) -> list[Any]:
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    # -- the reader thread --------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                more = self.poll_once()
            except Exception:  # a bug here must cost events, never the scheduler
                logger.exception("kvstrata: reading the sidecar's tier events failed")
                more = False
            if not more:
                self._stop.wait(self.poll_interval_s)

    def poll_once(self) -> bool:
        """Read one batch of the journal; True if there may be more right away.

        Safe beside the reader thread: polls run one at a time, so each
        record becomes an event once.
        """
        with self._poll_lock:
            return self._poll_locked()

    def _poll_locked(self) -> bool:
        reply = self.client.events(self._after)
        if reply is None:
            return False
        if reply.journal_id != self._journal_id:  # a new sidecar: its numbering starts over
            if self._journal_id is not None:
                self._add(self._l1_lost())
            self._journal_id = reply.journal_id
            if self._after:
                self._after = 0
                return True  # this reply began at our old place: read from the start
        self._after = reply.next_seq
        self.lost_total += reply.lost
        self._add([e for e in map(self._convert, reply.events) if e is not None])
        return len(reply.events) > 0

    def _add(self, made: list[Any]) -> None:
        if made:
            with self._lock:
                self._pending.extend(made)
                excess = len(self._pending) - MAX_PENDING_EVENTS
                if excess > 0:
                    del self._pending[:excess]
                    self.dropped_total += excess

    def _l1_lost(self) -> list[Any]:
        """The restarted sidecar's L1 is empty: one BlockRemoved (CPU) naming
        every block announced there (see the module docstring)."""
        hashes = [h for chunk in self._in_l1.values() for h in chunk]
        self._in_l1.clear()
        if not hashes:
            return []
        medium, locality = tier_medium("l1")
        common = {"block_hashes": hashes, "medium": medium, "locality": locality,
                  "ownership": TIER_OWNERSHIP.format(tier="l1")}  # fmt: skip
        return [self._classes.make(self._classes.removed, common)]

    def _convert(self, record: p.TierEvent) -> Any:
        key = bytes(record.key)
        description = self.registry.get(key)
        announced = self._in_l1.pop(key, None) if record.tier == "l1" else None
        if description is None and announced is None:
            self.undescribed_total += 1
            return None
        medium, locality = tier_medium(record.tier)
        if description is not None:
            hashes = [self._classes.convert(h) for h in description.block_hashes]
        else:
            hashes = announced or []
        common = {
            "block_hashes": hashes,
            "medium": medium,
            "locality": locality,
            "ownership": TIER_OWNERSHIP.format(tier=record.tier),
        }
        if record.kind == "removed":
            return self._classes.make(self._classes.removed, common)
        if description is None:  # a store needs the tokens only a description has
            self.undescribed_total += 1
            return None
        if record.tier == "l1":
            self._in_l1[key] = hashes
            while len(self._in_l1) > MAX_DESCRIBED_CHUNKS:
                self._in_l1.popitem(last=False)
        parent = description.parent_hash
        return self._classes.make(
            self._classes.stored,
            {
                **common,
                "parent_block_hash": self._classes.convert(parent) if parent else None,
                "token_ids": description.token_ids.tolist(),
                "block_size": self.block_size,
                "lora_id": description.lora_id,
                "lora_name": description.lora_name,
            },
        )


@dataclass(frozen=True, slots=True)
class _EventClasses:
    """The installed vLLM's event classes and hash conversion."""

    stored: type
    removed: type
    convert: Callable[[bytes], Any]

    @staticmethod
    def make(cls: type, fields: dict[str, Any]) -> Any:
        # Only the fields this vLLM's class has (older releases lack locality,
        # ownership): adapt rather than fail.
        known = set(getattr(cls, "__struct_fields__", fields))
        return cls(**{k: v for k, v in fields.items() if k in known})


def _vllm_event_classes() -> _EventClasses:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return _EventClasses(BlockStored, BlockRemoved, maybe_convert_block_hash)


def describe_chunks(
    registry: ChunkRegistry | None,
    request: Request,
    fingerprint: bytes,
    chunks: range,
    block_size: int,
    bpc: int,
) -> None:
    """Describe chunks when events are on (``registry`` set); never raises."""
    if registry is None or not chunks:
        return
    try:
        registry.describe(request, fingerprint, chunks, block_size, bpc)
    except Exception:
        logger.exception("kvstrata: cannot describe chunks of %s for KV events", request.request_id)
