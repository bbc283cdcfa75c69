"""The soak's hostile local clients: what one client in the pod can do to its sidecar.

Why a module of its own: each is a bare ZeroMQ (or socket) peer with a
thread of its own that the soak starts at a fault's beginning and stops at
its end; none of them is vLLM, so none of them may cost vLLM anything
but cache misses. Each is bounded (it stops opening, sending or storing
by itself) and keeps what it did for the JSON (:meth:`Hostile.report`).

* :class:`FdFlood` (``fd_flood``): more connections than the sidecar has
  descriptors (the soak runs the sidecar under ``prlimit``): ZeroMQ, HTTP
  and liveness at once, held open until the fault ends.
* :class:`UnreadReader` (``unread_reader``): asks for large EVENTS replies
  (its own namespace's journal, filled first) and never reads one; it
  measures the sidecar's resident memory before and once the sidecar has
  answered them all (its EVENTS count on /metrics), while they are unread.
* :class:`LeaseHog` (``lease_hog``): takes the largest write lease the
  sidecar grants, never commits, and keeps its session alive with PINGs
  until it vanishes at the fault's end; it stays at least until the sidecar
  shows its lease expired into quarantine (so the fault always covers a
  quarantined slot), and its session times out afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import urllib.request
from typing import Any

import zmq

from kvstrata.bench.soakchecks import resources
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.endpoint import ipc_path
from kvstrata.sidecar.keys import FINGERPRINT_BYTES
from kvstrata.sidecar.liveness import liveness_path
from kvstrata.testing.rawpeer import RawPeer

FD_FLOOD_ZMQ = 1100  # more than a 1024-descriptor sidecar can hold
FD_FLOOD_HTTP = 200
FD_FLOOD_LIVENESS = 200
UNREAD_CHUNKS = 4096  # chunks of the reader's own namespace: its journal records
# EVENTS requests, each answered with up to MAX_EVENTS records (about 260 KB):
# about 520 MB if the sidecar keeps every unread reply, beyond the soak's RSS bound.
UNREAD_REQUESTS = 2000
UNREAD_WAIT_S = 60.0
EVENTS_ANSWERED = r'^kvstrata_operation_duration_seconds_count\{op="EVENTS"\} (\S+)$'
HOG_PING_S = 1.0  # well inside the soak's client_timeout_seconds
HOG_EXPIRY_WAIT_S = 60.0  # at most this long past its fault's end for the expiry


def _key(fingerprint: bytes, n: int) -> bytes:
    return fingerprint + n.to_bytes(8, "big") * 4  # a key names its namespace first


class Hostile:
    """A hostile peer on a thread: :meth:`start` at the fault's beginning,
    :meth:`stop` at its end; :meth:`report` says what it did."""

    def __init__(self, endpoint: str, http_port: int) -> None:
        self.endpoint, self.http_port = endpoint, http_port
        self.done = threading.Event()
        self.counts: dict[str, Any] = {}
        self.error = ""
        self._thread = threading.Thread(target=self._guarded, daemon=True, name=type(self).__name__)

    def start(self) -> Hostile:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self._thread.join(timeout=30)

    def _get(self, path: str) -> bytes:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bytes(resp.read())

    def _get_json(self, path: str) -> Any:
        return json.loads(self._get(path))

    def report(self) -> dict[str, Any]:
        return {**self.counts, **({"error": self.error} if self.error else {})}

    def _guarded(self) -> None:
        try:
            self.run()
        except Exception as exc:  # the fault's own failure is reported, not raised
            self.error = repr(exc)

    def run(self) -> None:
        raise NotImplementedError


class FdFlood(Hostile):
    """ZeroMQ, HTTP and liveness connections beyond the sidecar's descriptors."""

    def run(self) -> None:
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, FD_FLOOD_ZMQ + 64)
        socks: list[zmq.Socket[bytes]] = []
        plain: list[socket.socket] = []
        live = ipc_path(self.endpoint)
        self.counts = {"zmq": 0, "http": 0, "liveness": 0, "refused": 0}
        try:
            # Interleaved, so every listener is short of descriptors at once.
            for i in range(max(FD_FLOOD_ZMQ, FD_FLOOD_HTTP, FD_FLOOD_LIVENESS)):
                if self.done.is_set():
                    break
                if i < FD_FLOOD_ZMQ:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(self.endpoint)
                    with contextlib.suppress(zmq.ZMQError):
                        s.send(b"\xc1not msgpack", zmq.NOBLOCK)
                    socks.append(s)
                    self.counts["zmq"] += 1
                if i < FD_FLOOD_HTTP:
                    self._connect(plain, socket.AF_INET, ("127.0.0.1", self.http_port), "http")
                if i < FD_FLOOD_LIVENESS and live is not None:
                    self._connect(plain, socket.AF_UNIX, liveness_path(live), "liveness")
            self.done.wait()
        finally:
            for s in socks:
                s.close(0)
            for c in plain:
                c.close()
            ctx.term()

    def _connect(self, into: list[socket.socket], family: int, address: Any, name: str) -> None:
        conn = socket.socket(family, socket.SOCK_STREAM)
        conn.settimeout(2.0)
        try:
            conn.connect(address)
        except OSError:
            conn.close()
            self.counts["refused"] += 1
            return
        into.append(conn)
        self.counts[name] += 1


class UnreadReader(Hostile):
    """Large EVENTS replies asked for and never read."""

    def __init__(self, endpoint: str, http_port: int) -> None:
        super().__init__(endpoint, http_port)
        self._sent_all = threading.Event()  # every request sent, or the thread is gone

    def stop(self) -> None:
        """Vanish once every request is sent (at most a minute past the fault's
        end: a quick soak's fault is over before the journal is filled)."""
        self._sent_all.wait(UNREAD_WAIT_S)
        super().stop()

    def _guarded(self) -> None:
        try:
            super()._guarded()
        finally:
            self._sent_all.set()

    def _events_answered(self) -> float:
        """EVENTS requests the sidecar answered (its per-op histogram's count)."""
        text = self._get("/metrics").decode()
        found = re.search(EVENTS_ANSWERED, text, re.M)
        return float(found.group(1)) if found else 0.0

    def run(self) -> None:
        fingerprint = b"\x02" * FINGERPRINT_BYTES
        peer = RawPeer(self.endpoint)
        # Its receive side holds one message; the rest waits at the sidecar.
        peer.sock.setsockopt(zmq.RCVHWM, 1)
        self.counts = {"stored": 0, "sent": 0, "blocked": 0}
        try:
            peer.hello(fingerprint, client_id="soak-unread-reader", kv_events=True)
            self._fill_journal(peer, fingerprint)
            stats = peer.call(p.STATS, {}, request_id=999)
            pid = int(stats[3]["stats"]["pid"])  # the sidecar's, as STATS tells it
            self.counts["rss_before"] = resources(pid)["rss_bytes"]
            answered = self._events_answered()
            rid = 1000
            while self.counts["sent"] < UNREAD_REQUESTS:
                rid += 1
                body = {"after": 0, "limit": p.MAX_EVENTS}
                frame = [p.PROTOCOL_VERSION, rid, p.EVENTS, peer.session_id, body]
                try:
                    peer.sock.send(_pack(frame), zmq.NOBLOCK)
                    self.counts["sent"] += 1
                except zmq.Again:  # its own send queue is full: the sidecar stopped reading
                    self.counts["blocked"] += 1
                    if self.done.wait(0.05):
                        break
            # Every reply made (answered, not read): what the sidecar holds now.
            deadline = time.monotonic() + UNREAD_WAIT_S
            while self._events_answered() < answered + self.counts["sent"]:
                if time.monotonic() > deadline or self.done.wait(0.1):
                    break
            else:
                self.counts["rss_held"] = resources(pid)["rss_bytes"]
            self._sent_all.set()
            self.done.wait()
        finally:
            peer.close()

    def _fill_journal(self, peer: RawPeer, fingerprint: bytes) -> None:
        """Chunks of its own namespace (uncopied: only the journal matters)."""
        batch = 128
        for start in range(0, UNREAD_CHUNKS, batch):
            keys = [_key(fingerprint, n) for n in range(start, start + batch)]
            body = {"keys": keys, "nbytes": 64, "dtype": "uint8", "shape": [64], "owner": "u"}
            reply = peer.call(p.PREPARE_STORE, body, request_id=start + 1)
            ids = [s[0] for s in (reply[3].get("slots", []) if reply[2] else []) if s]
            if ids:
                peer.call(
                    p.COMMIT_STORE,
                    {"lease_ids": ids, "ok": [True] * len(ids)},
                    request_id=start + 2,
                )
                self.counts["stored"] += len(ids)


class LeaseHog(Hostile):
    """The largest write lease it is granted, held silently with its session alive."""

    def __init__(self, endpoint: str, http_port: int) -> None:
        super().__init__(endpoint, http_port)
        self.quarantined = threading.Event()  # the sidecar shows its slot quarantined
        # Quarantined, or nothing left to wait for (its session or thread is gone).
        self._settled = threading.Event()

    def stop(self) -> None:
        """Vanish, once the sidecar has quarantined the expired lease (or has
        lost it with the hog's session: a restarted sidecar knows neither)."""
        if self._thread.is_alive():
            self._settled.wait(HOG_EXPIRY_WAIT_S)
        self.counts["quarantined_seen"] = self.quarantined.is_set()
        super().stop()

    def _guarded(self) -> None:
        try:
            super()._guarded()
        finally:
            self._settled.set()

    def _quarantined_bytes(self) -> int:
        return int(self._get_json("/status")["counters"].get("quarantined_bytes", 0))

    def run(self) -> None:
        fingerprint = b"\x03" * FINGERPRINT_BYTES
        peer = RawPeer(self.endpoint)
        try:
            hello = {
                "client_id": "soak-lease-hog",
                "role": "worker",
                "fingerprint": fingerprint,
                "transfer_mode": "host",
                "pid": os.getpid(),
            }
            reply = peer.call(p.HELLO, hello, session_id="")
            if not reply[2]:
                raise RuntimeError(f"HELLO refused: {reply[3]}")
            peer.session_id = str(reply[3]["session_id"])
            arena = int(reply[3]["arena_size"])
            # The whole arena first, as a hostile client would; then its budget.
            self.counts = {"arena_bytes": arena, "asked": [], "granted_bytes": 0}
            for n, size in enumerate((arena, int(reply[3].get("write_budget") or arena // 4))):
                body = {"keys": [_key(fingerprint, n)], "nbytes": size, "dtype": "uint8",
                        "shape": [size], "owner": "hog"}  # fmt: skip
                answer = peer.call(p.PREPARE_STORE, body, request_id=10 + n)
                slot = answer[3]["slots"][0] if answer[2] else None
                self.counts["asked"].append({"bytes": size, "granted": slot is not None})
                if slot is not None:
                    self.counts["granted_bytes"] = size
                    break
            rid = 100
            if not self.counts["granted_bytes"]:
                self._settled.set()  # nothing granted: nothing to see expire
            while not self.done.wait(HOG_PING_S):  # alive, and silent about its lease
                rid += 1
                try:
                    pong = peer.call(p.PING, {}, request_id=rid)
                except zmq.Again:  # a stopped sidecar: ask again
                    continue
                if pong[2] and pong[3].get("session_valid") is False:
                    self.counts["session_lost"] = True  # the sidecar restarted meanwhile
                    self._settled.set()
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    granted = self.counts["granted_bytes"]
                    if granted and self._quarantined_bytes() >= granted:
                        self.quarantined.set()
                        self._settled.set()
        finally:
            peer.close()  # it vanishes: its session times out, its slot is freed then


def _pack(frame: list[Any]) -> bytes:
    import msgpack

    return msgpack.packb(frame)


HOSTILE: dict[str, type[Hostile]] = {
    "fd_flood": FdFlood,
    "unread_reader": UnreadReader,
    "lease_hog": LeaseHog,
}
