"""Encryption at rest: the keys that seal chunk objects below L1.

Why its own module: the disk tier and both shared tiers seal and open
objects the same way (:mod:`.objformat` version 4); this module owns the
keys they use and nothing else.

Keys come from a folder the operator fills from a Kubernetes Secret
(``encryption.key_dir``, mounted read-only)::

    <key_dir>/keyring.json     {"writing": "<key id>", ...}  (other fields: the
                               operator's bookkeeping, ignored here)
    <key_dir>/<key id>.key     32 raw bytes: an AES-256 key

Every ``*.key`` file is a key for reading; the one ``keyring.json`` names
is the writing key. A rotation adds a key and names it writing; old keys
stay for reading until the operator prunes them (docs/security.md).

A tenant's key is derived from the KVCache key with HKDF-SHA256 and the
tenant's name as its info, so one Secret serves every tenant; the object's
header carries the tenant's name as its derivation label.

The kubelet updates a mounted Secret in place by swapping a ``..data``
symlink; :meth:`KeyRing.refresh` notices the swap (or any change of a
file's size or time) and reloads, keeping the old keys when the new folder
does not parse, so a bad update costs nothing that worked before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstrata.sidecar.objformat import SealError
from kvstrata.sidecar.sealbuffers import SealBuffers

logger = logging.getLogger(__name__)

EncryptionMode = Literal["off", "on", "required"]
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_SUFFIX = ".key"
INDEX_FILE = "keyring.json"
_BLOCK = 16
KEY_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_TENANT_INFO = b"kvstrata tenant key\0"


class StreamCipher:
    """One object's AES-GCM applied piece by piece, in order: sealing as the
    object goes out (into the buffer the send or the file write reads), or
    opening as it comes in (straight into its destination).

    Why: a whole-object seal is a pass over the payload of its own before
    the first byte goes out, on a thread the send then waits behind; sealed
    piece by piece, the next piece is sealed while the socket or the disk
    still takes the last one, and a file's ciphertext is written straight
    into the aligned buffer the write goes from (no second pass). The bytes
    are those of :meth:`AESGCM.encrypt` (ciphertext, then the 16-byte tag),
    checked in tests/unit/sidecar/test_sealed_streams.py.

    An opened piece is plaintext not yet authenticated: whoever opens
    must not use any of it before :meth:`verify` returned.
    """

    __slots__ = ("_context",)

    def __init__(self, context: Any) -> None:
        self._context = context

    def apply_into(self, data: memoryview, out: memoryview) -> None:
        """Seal (or open) the next ``len(data)`` bytes into ``out[:len(data)]``."""
        n = len(data)
        # update_into wants room for a block beyond the data (it checks
        # len(out) >= len(data) + 15); without it, the last bytes go through
        # update, which returns them (a few bytes, allocated).
        split = n if len(out) - n >= _BLOCK - 1 else max(n - _BLOCK, 0)
        if split:
            written = self._context.update_into(data[:split], out)
            if written != split:  # GCM never holds bytes back; pinned by a test
                raise RuntimeError(f"AES-GCM update wrote {written} of {split} bytes")
        if split < n:
            out[split:n] = self._context.update(data[split:n])

    def tag(self) -> bytes:
        """Sealing: the 16-byte tag, once every byte went through."""
        self._context.finalize()
        return bytes(self._context.tag)

    def verify(self, tag: bytes | memoryview) -> None:
        """Opening: check the tag once every byte went through;
        :class:`SealError` (``auth_failed``) when the object is not authentic."""
        try:
            self._context.finalize_with_tag(bytes(tag))
        except (InvalidTag, ValueError):
            raise SealError("auth_failed", "authentication tag mismatch") from None


def _gcm_stream(material: bytes, nonce: bytes, aad: bytes, sealing: bool) -> StreamCipher:
    """AES-GCM under ``material`` and ``nonce``, ``aad`` authenticated, as a
    :class:`StreamCipher` that seals (or opens)."""
    cipher = Cipher(algorithms.AES(material), modes.GCM(nonce))
    context = cipher.encryptor() if sealing else cipher.decryptor()
    context.authenticate_additional_data(aad)
    return StreamCipher(context)


class KeyFolderError(ValueError):
    """The key folder cannot be used; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class KeySet:
    """The keys one read of the folder found."""

    keys: dict[str, bytes]
    writing: str | None


def read_key_folder(path: str) -> KeySet:
    """Parse ``path`` (module docstring); raise :class:`KeyFolderError` naming what is wrong."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise KeyFolderError(f"encryption.key_dir: cannot list {path}: {exc.strerror}") from None
    keys: dict[str, bytes] = {}
    for name in names:
        if not name.endswith(KEY_SUFFIX) or name.startswith(".."):
            continue
        key_id = name[: -len(KEY_SUFFIX)]
        if not KEY_ID_RE.match(key_id):
            raise KeyFolderError(f"{path}/{name}: key id {key_id!r} is not [a-z0-9-], 1..63")
        with open(os.path.join(path, name), "rb") as fh:
            material = fh.read(KEY_BYTES + 1)
        if len(material) != KEY_BYTES:
            raise KeyFolderError(f"{path}/{name}: a key is {KEY_BYTES} bytes, not {len(material)}")
        keys[key_id] = material
    writing: str | None = None
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as fh:
                doc = json.load(fh)
            writing = doc["writing"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyFolderError(f"{index}: no 'writing' key id ({exc})") from None
        if writing not in keys:
            raise KeyFolderError(f"{index}: writing key {writing!r} has no {writing}.key")
    elif len(keys) == 1:
        writing = next(iter(keys))  # one key and no index: it writes
    elif keys:
        raise KeyFolderError(f"{index}: missing, and {len(keys)} keys to choose the writing one")
    return KeySet(keys, writing)


def _folder_fingerprint(path: str) -> tuple[object, ...]:
    """What changes whenever the kubelet (or anyone) changes the folder."""
    try:
        link = os.readlink(os.path.join(path, "..data"))
    except OSError:
        link = ""
    entries: list[tuple[str, int, int]] = []
    try:
        for name in sorted(os.listdir(path)):
            try:
                st = os.stat(os.path.join(path, name))
            except OSError:
                continue
            entries.append((name, st.st_mtime_ns, st.st_size))
    except OSError:
        return (link, None)
    return (link, tuple(entries))


class KeyRing:
    """The keys of one KVCache: seal with the writing key, open with any.

    Thread-safe: writer threads seal and readers open while :meth:`refresh`
    may swap the keys underneath (a swap replaces whole dicts).
    """

    def __init__(self, mode: EncryptionMode, key_dir: str | None) -> None:
        self.mode = mode
        self.key_dir = key_dir
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}
        self._writing: str | None = None
        self._ciphers: dict[tuple[str, str], tuple[AESGCM, bytes]] = {}
        self._fingerprint: tuple[object, ...] | None = None
        self.reloads_total = 0
        self.reload_failures_total = 0
        # Ciphertext buffers of objects sent to the shared tier, reused (.sealbuffers).
        self.buffers = SealBuffers()
        if mode == "off":
            return
        if key_dir is None:
            if mode == "required":
                raise KeyFolderError("encryption.key_dir: required when encryption.mode is set")
            return
        try:
            self._load()
        except KeyFolderError:
            if mode == "required":
                raise
            logger.warning("encryption on, keys not loaded; writing plaintext", exc_info=True)
        if mode == "required" and self._writing is None:
            raise KeyFolderError(f"encryption.key_dir: {key_dir} holds no key (mode: required)")

    # -- keys -------------------------------------------------------------

    def _load(self) -> None:
        key_dir = self.key_dir or ""
        fingerprint = _folder_fingerprint(key_dir)
        found = read_key_folder(key_dir)
        with self._lock:
            self._keys, self._writing = found.keys, found.writing
            self._ciphers = {}
            self._fingerprint = fingerprint
        logger.info(
            "encryption keys loaded from %s: %d, writing %s",
            key_dir,
            len(found.keys),
            found.writing,
        )

    def refresh(self) -> bool:
        """Reload the folder if it changed since the last load; whether it did.

        A folder that no longer parses keeps the keys loaded before (counted
        in ``reload_failures_total``).
        """
        if self.mode == "off" or self.key_dir is None:
            return False
        if _folder_fingerprint(self.key_dir) == self._fingerprint:
            return False
        try:
            self._load()
        except (KeyFolderError, OSError) as exc:
            logger.warning("encryption keys not reloaded, keeping the old ones: %s", exc)
            self.reload_failures_total += 1
            # Remember the broken state so it is reported once, not on every poll.
            self._fingerprint = _folder_fingerprint(self.key_dir)
            return False
        self.reloads_total += 1
        return True

    @property
    def key_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    @property
    def writing_key_id(self) -> str | None:
        with self._lock:
            return self._writing if self.mode != "off" else None

    def _cipher(self, key_id: str, label: str) -> tuple[AESGCM, bytes] | None:
        """The AES-GCM of ``key_id`` (derived for tenant ``label``) and its key."""
        with self._lock:
            cipher = self._ciphers.get((key_id, label))
            if cipher is not None:
                return cipher
            material = self._keys.get(key_id)
        if material is None:
            return None
        if label:
            hkdf = HKDF(SHA256(), KEY_BYTES, salt=None, info=_TENANT_INFO + label.encode())
            material = hkdf.derive(material)
        cipher = (AESGCM(material), material)
        with self._lock:
            self._ciphers[(key_id, label)] = cipher
        return cipher

    def _sealing_cipher(self, key_id: str, label: str) -> tuple[AESGCM, bytes]:
        """:meth:`_cipher` for sealing; SealError when the key is gone."""
        cipher = self._cipher(key_id, label)
        if cipher is None:  # the writing key was rotated out between params and here
            raise SealError("unknown_key", f"writing key {key_id!r} is gone")
        return cipher

    def _opening_cipher(self, key_id: str, label: str) -> tuple[AESGCM, bytes]:
        """:meth:`_cipher` for opening; SealError when there is no such key
        (or encryption is off)."""
        cipher = self._cipher(key_id, label) if self.mode != "off" else None
        if cipher is None:
            reason = "no_key" if self.mode == "off" else "unknown_key"
            raise SealError(reason, f"no key {key_id!r} to open the object with")
        return cipher

    def sealing_stream(self, key_id: str, label: str, nonce: bytes, aad: bytes) -> StreamCipher:
        """A :class:`StreamCipher` that seals one object under ``key_id``."""
        return _gcm_stream(self._sealing_cipher(key_id, label)[1], nonce, aad, sealing=True)

    def opening_stream(self, key_id: str, label: str, nonce: bytes, aad: bytes) -> StreamCipher:
        """A :class:`StreamCipher` that opens one object sealed under ``key_id``;
        :class:`SealError` when there is no such key (or encryption is off)."""
        return _gcm_stream(self._opening_cipher(key_id, label)[1], nonce, aad, sealing=False)

    # -- sealing ----------------------------------------------------------

    def seal_params(self, tenant: str | None = None) -> tuple[str, str, bytes] | None:
        """(key id, tenant label, fresh nonce) to seal a new object with, or
        None when objects are written in plaintext (mode off, or no key yet)."""
        key_id = self.writing_key_id
        if key_id is None:
            return None
        return key_id, tenant or "", os.urandom(NONCE_BYTES)

    def encrypt(
        self, key_id: str, label: str, nonce: bytes, data: bytes | memoryview, aad: bytes
    ) -> bytes:
        """Ciphertext then the 16-byte tag."""
        return self._sealing_cipher(key_id, label)[0].encrypt(nonce, data, aad)

    def decrypt(
        self, key_id: str, label: str, nonce: bytes, data: bytes | memoryview, aad: bytes
    ) -> bytes:
        """The plaintext of ciphertext-then-tag ``data``; :class:`SealError` if it
        cannot be opened (reason ``unknown_key`` or ``auth_failed``)."""
        cipher = self._opening_cipher(key_id, label)[0]
        try:
            return cipher.decrypt(nonce, data, aad)
        except InvalidTag:
            raise SealError("auth_failed", "authentication tag mismatch") from None

    def decrypt_into(
        self,
        key_id: str,
        label: str,
        nonce: bytes,
        data: memoryview,
        aad: bytes,
        out: memoryview,
    ) -> None:
        """:meth:`decrypt` written into ``out`` (``len(data) - 16`` bytes; it may
        be the start of ``data`` itself). On :class:`SealError` ``out`` holds garbage."""
        cipher = self._opening_cipher(key_id, label)[0]
        if len(out) != len(data) - TAG_BYTES:
            raise SealError("auth_failed", "sealed payload shorter than its tag")
        try:
            cipher.decrypt_into(nonce, data, aad, out)
        except InvalidTag:
            raise SealError("auth_failed", "authentication tag mismatch") from None

    def check_plaintext(self) -> None:
        """Raise :class:`SealError` when a plaintext object must not be served."""
        if self.mode == "required":
            raise SealError("plaintext", "plaintext object where encryption is required")


class KeyWatcher:
    """Polls a :class:`KeyRing`'s folder every ``interval`` seconds on its own thread."""

    def __init__(self, ring: KeyRing, interval: float) -> None:
        self._ring = ring
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-keys", daemon=True)

    def start(self) -> None:
        if self._ring.mode != "off" and self._ring.key_dir is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._ring.refresh()
            except Exception:  # a watcher that dies would freeze rotation silently
                logger.exception("encryption key refresh failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
