"""L2: a capacity-bounded directory of chunk files on local disk.

Why: L1 is small and dies with the pod; a local NVMe holds many times more
and survives a sidecar restart, at a fraction of a remote tier's latency.

Persisted state, under ``l2.path``::

    <root>/<ss>/<key hex>.kvs      one chunk object in the objformat layout
                                   (header + raw payload, codec "none"; with
                                   encryption on: header + ciphertext + tag)
    <root>/<ss>/<key hex>.kvs.tmp-<rand>   a write in progress (removed on start)

``<ss>`` is the last two hex digits of the key (the block hash's last byte,
uniform), so no directory grows past 1/256 of the files. A file appears
under its final name only by ``rename`` after a complete write, so a crash
leaves either the old state or a stray temp file, never a half object
under a real name.

Files are written and read past the page cache (``O_DIRECT``, see
:mod:`.direct_io`) where the filesystem allows it, and through it where not; the
bytes on disk are the same either way.

On start the directory is re-indexed by reading each file's header only
(a few hundred bytes), so a restarted sidecar hits at once. A file whose
header, length or payload checksum is wrong is deleted and counted in
``corrupt_total``; it is a miss, never data. Eviction is LRU by bytes;
``usage_bytes`` never exceeds ``size_bytes`` (space is reserved before a
write starts).

Parts: which files are held, their order and what they use, and which to
evict (:mod:`.disk_index`); how a file is written and read
(:mod:`.disk_files`). This module decides what happens to an object.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import (
    ChunkMeta,
    CorruptObjectError,
    DecodedObject,
    ObjectHeader,
    OpenedInto,
    SealError,
    SealingPayload,
    decode,
    decode_header,
    encode_for_file,
    is_sealed,
)
from kvstrata.sidecar.tierchoice import TierChoice
from kvstrata.sidecar.tiers.base import Tier, TierStats
from kvstrata.sidecar.tiers.direct_io import HashingCopy
from kvstrata.sidecar.tiers.disk_files import TMP_MARK, DiskFiles
from kvstrata.sidecar.tiers.disk_index import DiskEntry, DiskIndex
from kvstrata.sidecar.tiers.file_choice import ChoiceNotRecorded, read_choice
from kvstrata.sidecar.tiers.tenant_shares import TenantFigures, TenantShares

if TYPE_CHECKING:
    from kvstrata.sidecar.journal import TierEvents
    from kvstrata.sidecar.sealing import KeyRing

logger = logging.getLogger(__name__)

SUFFIX = ".kvs"
_HEADER_PROBE = 512  # > the largest header (56 + 8*8 + 1 + 255)


class DiskTier(Tier):
    """Chunk files under one directory (see the module docstring)."""

    name = "l2"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        fsync: bool = False,
        namespace_quota: int | None = None,
        direct: bool = True,
        keys: KeyRing | None = None,
        young_seconds: float = 60.0,
        tenants: TenantShares | None = None,
    ):
        self.root = os.fspath(path)
        # Seal files written, open files read (None: encryption off).
        self._keys = keys
        # Plaintext files may not be read straight into L1: each read is checked.
        self._plaintext_refused = keys is not None and keys.mode == "required"
        self.capacity_bytes = capacity_bytes
        # Per-tenant budgets and bytes (tiers.tenant_shares); kept under self._lock.
        self.tenants = tenants or TenantShares()
        # The files held, their LRU order, usage and evictions (tiers.disk_index);
        # changed under self._lock only.
        self._index = DiskIndex(capacity_bytes, namespace_quota, self.tenants, young_seconds)
        # Files go past the page cache (tiers.direct_io) until the filesystem
        # refuses O_DIRECT once; then buffered, said once in the log.
        self._files = DiskFiles(self.root, direct=direct, fsync=fsync)
        self._lock = threading.Lock()
        # Told of each file stored and each one removed (the KV event journal), when set.
        self.events: TierEvents | None = None
        self._stats = TierStats(tier=self.name, capacity_bytes=capacity_bytes)
        try:
            os.makedirs(self.root, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
            self._reindex()
        except OSError as exc:
            raise ValueError(f"l2.path: cannot use {self.root!r}: {exc.strerror or exc}") from None

    @property
    def direct_io(self) -> bool:
        """Whether files go past the page cache (until the filesystem refuses it)."""
        return self._files.direct_io

    # -- paths ------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        hexkey = key_hex(key)
        return os.path.join(self.root, hexkey[-2:], hexkey + SUFFIX)

    # -- start-up ---------------------------------------------------------------

    def _reindex(self) -> None:
        found: list[tuple[float, bytes, DiskEntry]] = []
        for shard in sorted(os.listdir(self.root)):
            shard_dir = os.path.join(self.root, shard)
            if len(shard) != 2 or not os.path.isdir(shard_dir):
                continue
            for fname in os.listdir(shard_dir):
                fpath = os.path.join(shard_dir, fname)
                if TMP_MARK in fname:
                    with contextlib.suppress(OSError):
                        os.unlink(fpath)
                    continue
                if not fname.endswith(SUFFIX):
                    continue
                item = self._probe(fpath, fname[: -len(SUFFIX)])
                if item is not None:
                    found.append(item)
        found.sort(key=lambda t: t[0])  # oldest access first = LRU order
        for _, key, entry in found:
            self._index.add(key, entry)
        self._unlink_all(self._removed(self._index.evict(0)))
        logger.info(
            "L2 %s: %d objects, %d bytes re-indexed", self.root, len(self._index), self._index.usage
        )

    def _probe(self, fpath: str, hexkey: str) -> tuple[float, bytes, DiskEntry] | None:
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            return None
        try:
            with open(fpath, "rb") as fh:
                st = os.fstat(fh.fileno())
                head = fh.read(_HEADER_PROBE)
            header = decode_header(head, expected_key=key)
            if header.object_length != st.st_size:
                raise CorruptObjectError("file length does not match its header")
        except CorruptObjectError as exc:
            logger.warning("L2 file %s is corrupt (%s); deleted", fpath, exc)
            self._stats.corrupt_total += 1
            with contextlib.suppress(OSError):
                os.unlink(fpath)
            return None
        except OSError:
            return None
        # The sealed header's tenant, if it is one this sidecar knows.
        # The sealed header's tenant, if it is one this sidecar knows, and the
        # store choice the file carries (.file_choice).
        meta = replace(
            header.meta,
            tenant=self.tenants.name(header.meta.tenant),
            store_tiers=read_choice(fpath),
        )
        entry = DiskEntry(
            st.st_size,
            header.header_length,
            header.raw_length,
            meta,
            header.codec,
            sealed=header.seal is not None,
            written_unix=st.st_mtime,
        )
        return max(st.st_atime, st.st_mtime), key, entry

    # -- Tier -------------------------------------------------------------------

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            index = self._index
            return [k in index for k in keys]

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._index

    def peek(self, key: bytes) -> DiskEntry | None:
        """Size and meta of a stored object, without touching the disk."""
        with self._lock:
            return self._index.get(key)

    def put(self, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta) -> bool:
        # On the writer thread that calls put: sealing never runs on the serving
        # thread. A sealed payload is sealed as the file is written (.direct_io).
        header, stored = encode_for_file(key, payload, meta, self._keys)
        total = len(header) + len(stored)
        with self._lock:
            if self._index.touch(key) is not None:
                self._stats.deduplicated_total += 1
                return True
            # Too large, over its tenant's budget, or the rest pinned: dropped.
            fits, evicted = self._index.admit(key, meta.tenant, total)
            doomed = self._removed(evicted)
            if not fits:
                self._stats.dropped_total += 1
        self._unlink_all(doomed)
        if not fits:
            return False
        try:
            ok = self._write_file(key, header, stored, meta.store_tiers)
        finally:
            with self._lock:
                self._index.release(meta.tenant, total)
        if not ok:
            return False
        entry = DiskEntry(
            total,
            len(header),
            memoryview(payload).nbytes,
            meta,
            sealed=is_sealed(header),
            stored_at=time.monotonic(),
            written_unix=time.time(),
        )
        self._index_written(key, entry, len(stored))
        return True

    def _index_written(self, key: ChunkKey, entry: DiskEntry, stored_bytes: int) -> None:
        """Index a file just written, in place of any older one under its key."""
        with self._lock:
            old = self._index.add(key, entry)
            self._stats.stored_bytes_total += stored_bytes
            if old is None and self.events is not None:
                self.events.stored(key)

    def _write_file(
        self,
        key: bytes,
        header: bytes,
        stored: memoryview | SealingPayload,
        choice: TierChoice = None,
    ) -> bool:
        """Write the object's file; its store ``choice`` goes with it (.file_choice)."""
        final = self.path_of(key)
        try:
            self._files.write(final, [memoryview(header), stored], choice)
            return True
        except ChoiceNotRecorded as exc:
            logger.warning("L2 keeps no %s: its request's tier choice cannot be kept (%s)",
                           final, exc)  # fmt: skip
            with self._lock:
                self._stats.count_error("ChoiceNotRecorded")
            return False
        except OSError as exc:
            logger.warning("L2 write of %s failed: %s", final, exc)
            with self._lock:
                self._stats.count_error(type(exc).__name__)
            return False

    def read_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        """Read the payload of ``key`` straight into ``out``; its meta, or None.

        The payload lands in ``out`` in segments, each checksummed while it
        is still in the CPU cache (a separate checksum pass after the read
        would cost a second trip through memory). On None, ``out`` may hold
        garbage.
        """
        entry = self._touch(key)
        if entry is None:
            return None
        if len(out) < entry.payload_bytes:
            raise ValueError(f"buffer of {len(out)} bytes for a {entry.payload_bytes}-byte object")
        if entry.codec != "none" or (self._plaintext_refused and not entry.sealed):
            # Compressed, or to be refused as plaintext: the whole file is read and decoded.
            obj = self._decode_file(key, entry)
            if obj is None:
                return None
            out[: len(obj.payload)] = obj.payload
            return obj.meta
        # Plaintext is copied and hashed, a sealed payload opened into ``out``,
        # segment by segment as the file is read (.direct_io).
        target = out[: entry.payload_bytes]
        sink = OpenedInto(self._keys, key, target) if entry.sealed else HashingCopy(target)
        head = bytearray(entry.header_bytes)
        path = self.path_of(key)
        try:
            got_head, got, size = self._files.read(path, head, entry.file_bytes - len(head), sink)
            if got_head + got != entry.file_bytes or size != entry.file_bytes:
                raise CorruptObjectError("file length changed")
            if isinstance(sink, OpenedInto):
                header = sink.finish()
            else:
                header = self._checked(key, head, got, sink)
        except FileNotFoundError:
            self._forget(key, missing=True)
            return None
        except SealError as exc:
            self._discard_sealed(key, path, exc.reason)
            return None
        except CorruptObjectError as exc:
            self._discard_corrupt(key, path, str(exc))
            return None
        except OSError as exc:
            self._count_error(exc)
            return None
        with self._lock:
            self._stats.hits_total += 1
            self._stats.retrieved_bytes_total += entry.payload_bytes
        return header.meta

    @staticmethod
    def _checked(key: bytes, head: bytearray, got: int, sink: HashingCopy) -> ObjectHeader:
        """The header of a plaintext file read whole; CorruptObjectError unless
        its payload is the one the header describes."""
        header = decode_header(head, expected_key=key)
        if header.codec != "none" or header.stored_length != got:
            raise CorruptObjectError("payload length mismatch")
        if sink.digest != header.checksum:
            raise CorruptObjectError("payload checksum mismatch")
        return header

    def get(self, key: ChunkKey) -> DecodedObject | None:
        entry = self.peek(key)
        if entry is None:
            with self._lock:
                self._stats.misses_total += 1
            return None
        if entry.codec == "none" and (entry.sealed or not self._plaintext_refused):
            buf = bytearray(entry.payload_bytes)
            meta = self.read_into(key, memoryview(buf))
            return None if meta is None else DecodedObject(meta, buf)
        return self._decode_file(key, entry)

    def _decode_file(self, key: bytes, entry: DiskEntry) -> DecodedObject | None:
        """The whole file of ``key`` (a compressed one, or any where plaintext
        is refused), checked and decoded; None (a miss, counted; the file
        deleted when it is bad)."""
        path = self.path_of(key)
        try:
            # The whole file in one buffer of its own, read as plaintext files
            # are (past the page cache where allowed); a sealed one is opened
            # over itself: no second buffer.
            blob = memoryview(bytearray(entry.file_bytes))
            split = entry.header_bytes
            payload = blob[split:]
            hashed = HashingCopy(payload)
            got_head, got, size = self._files.read(path, blob[:split], len(payload), hashed)
            if got_head + got != entry.file_bytes or size != entry.file_bytes:
                raise CorruptObjectError("file length changed")
            # What was hashed while it was read is a version-2 payload's whole
            # checksummed span (no trailer, no tag): decode need not hash it again.
            header = decode_header(blob[:split], expected_key=key)
            digest = hashed.digest if header.seal is None and not header.trailer else None
            obj = decode(
                blob, expected_key=key, payload_xxh3=digest, keys=self._keys, in_place=True
            )
        except SealError as exc:
            self._discard_sealed(key, path, exc.reason)
            return None
        except CorruptObjectError as exc:
            self._discard_corrupt(key, path, str(exc))
            return None
        except OSError:
            self._forget(key, missing=True)
            return None
        with self._lock:
            self._stats.hits_total += 1
            self._stats.retrieved_bytes_total += len(obj.payload)
        return obj

    def remove(self, key: ChunkKey) -> None:
        if self._forget(key):
            self._unlink_all([self.path_of(key)])

    def clear(self) -> None:
        with self._lock:
            paths = self._removed(self._index.clear())
        self._unlink_all(paths)

    def tenant_files(self, tenants: Collection[str]) -> list[tuple[bytes, str, float]]:
        """(key, tenant, time.time() when written) of the files of ``tenants``,
        oldest first: what a TTL needs of the files found at start."""
        with self._lock:
            found = [
                (key, e.meta.tenant, e.written_unix)
                for key, e in self._index.items()
                if e.meta.tenant in tenants
            ]
        return sorted(found, key=lambda t: t[2])

    def tenant_figures(self) -> TenantFigures:
        """A copy of the tenants' bytes, refusals and evictions here."""
        with self._lock:
            shares = self.tenants
            return TenantFigures(dict(shares.usage), dict(shares.refusals), dict(shares.evictions))

    def stats(self) -> TierStats:
        with self._lock:
            index = self._index
            return replace(
                self._stats,
                usage_bytes=index.usage,
                objects=len(index),
                evictions_total=index.evictions_total,
                young_evictions_total=index.young_evictions_total,
                errors_total=dict(self._stats.errors_total),
                decrypt_failures_total=dict(self._stats.decrypt_failures_total),
            )

    @property
    def usage_bytes(self) -> int:
        return self._index.usage + self._index.reserved

    # -- internals --------------------------------------------------------------

    def _touch(self, key: bytes) -> DiskEntry | None:
        with self._lock:
            entry = self._index.touch(key)
            if entry is None:
                self._stats.misses_total += 1
            return entry

    def _removed(self, keys: list[bytes]) -> list[str]:
        """Caller holds the lock: ``keys`` left the index (the journal is told,
        when there is one); the paths of their files, to unlink."""
        if self.events is not None:
            for key in keys:
                self.events.removed(key)
        return [self.path_of(key) for key in keys]

    def _forget(self, key: bytes, missing: bool = False) -> bool:
        with self._lock:
            if self._index.pop(key) is None:
                return False
            self._removed([key])
            if missing:
                self._stats.misses_total += 1
                self._stats.count_error("file_vanished")
            return True

    def _discard_sealed(self, key: bytes, path: str, reason: str) -> None:
        """A file the keys cannot open (or a plaintext one where encryption is
        required): counted by reason, a miss, deleted (a local file under a
        pruned key can never be opened again)."""
        logger.debug("L2 object %s not opened: %s", path, reason)
        with self._lock:
            self._stats.count_decrypt_failure(reason)
            self._stats.misses_total += 1
        if self._forget(key):
            self._unlink_all([path])

    def _discard_corrupt(self, key: bytes, path: str, why: str) -> None:
        logger.warning("L2 object %s is corrupt (%s); deleted", path, why)
        with self._lock:
            self._stats.corrupt_total += 1
            self._stats.misses_total += 1
        if self._forget(key):
            self._unlink_all([path])

    def _count_error(self, exc: OSError) -> None:
        with self._lock:
            self._stats.count_error(type(exc).__name__)
            self._stats.misses_total += 1

    @staticmethod
    def _unlink_all(paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
