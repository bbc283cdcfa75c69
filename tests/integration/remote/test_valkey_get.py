"""The Valkey tier's own GET reader (sidecar/tiers/valkey_get.py).

Against a real redis-server: batches that mix hits, misses and corrupt
values keep their order, values around the reader's buffer sizes arrive
whole. Against a fault double (a RESP server in a thread, named as such: a
reply cut at a chosen byte cannot be caused on a real server): a reply cut
short is retried once on a new connection, a stalled reply is a timed-out
miss whose connection is closed (the next read is whole), and error
replies are counted by kind.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest
import redis

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta, encode_streamed
from kvstrata.sidecar.tiers.valkey import ValkeyTier
from kvstrata.testing.destination import Destination
from kvstrata.testing.servers import LOOPBACK, RedisServer

NS = Namespace(model="valkey-get").fingerprint()


def _key(i: int) -> ChunkKey:
    return make_key(NS, i.to_bytes(32, "big"))


def _payload(size: int, seed: int) -> bytes:
    return bytes((seed + i * 131) % 251 for i in range(size))


META = ChunkMeta(dtype="uint8", shape=(1,))


def _tier(url: str, timeout: float = 5.0) -> ValkeyTier:
    return ValkeyTier(
        SharedConfig(
            backend="valkey",
            valkey={"url": url, "timeout_seconds": timeout},
            breaker_failures=100,
        )
    )


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "valkey") as valkey:
        yield valkey


def test_a_batch_mixing_hits_misses_and_a_corrupt_value_keeps_its_order(server) -> None:
    tier = _tier(server.url)
    # Around the reader's 64 KiB line buffer: values that arrive with their
    # header line, that straddle it and that are mostly received directly.
    sizes = [1, 65_000, 65_536, 200_000, 3 << 20]
    keys = [_key(i) for i in range(len(sizes) + 2)]
    payloads = [_payload(n, i) for i, n in enumerate(sizes)]
    assert tier.put_many([(k, p, META) for k, p in zip(keys, payloads, strict=False)])
    raw = redis.Redis.from_url(server.url)
    corrupt_name = "kvstrata:" + keys[1].hex()
    value = bytearray(raw.get(corrupt_name))
    value[len(value) // 2] ^= 0x01
    raw.set(corrupt_name, bytes(value))
    got = tier.get_many(keys)  # the last two were never stored
    assert [bytes(g.payload) if g else None for g in got] == [
        payloads[0], None, *payloads[2:], None, None
    ]  # fmt: skip
    stats = tier.stats()
    assert (stats.hits_total, stats.misses_total, stats.corrupt_total) == (4, 3, 1)
    assert raw.exists(corrupt_name) == 0  # the corrupt value was deleted
    assert stats.errors_total == {}


def test_a_value_stored_in_the_older_format_is_read_too(server) -> None:
    from kvstrata.sidecar.objformat import encode_bytes

    tier = _tier(server.url)
    key, payload = _key(1), _payload(100_000, 3)
    redis.Redis.from_url(server.url).set("kvstrata:" + key.hex(), encode_bytes(key, payload, META))
    (got,) = tier.get_many([key])
    assert got is not None and bytes(got.payload) == payload


# -- fault double --------------------------------------------------------------


class FakeRespServer:
    """Fault double: a RESP server that answers GET with ``reply(n)`` for the
    n-th GET it sees (a list of byte strings to send, then ``after``:
    "close" or "stall"), every other command with +OK. Counts connections."""

    def __init__(self, reply: Callable[[int], tuple[list[bytes], str]]) -> None:
        self._reply = reply
        self.gets = 0
        self.connections = 0
        self.closed_by_client = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with conn:
            while True:
                args = _read_command(reader)
                if args is None:
                    self.closed_by_client.set()
                    return
                if args[0].upper() != b"GET":
                    conn.sendall(b"+OK\r\n")
                    continue
                self.gets += 1
                parts, after = self._reply(self.gets)
                for part in parts:
                    conn.sendall(part)
                if after == "close":
                    return
                if after == "stall":
                    if reader.read(1) == b"":  # until the client gives up and closes
                        self.closed_by_client.set()
                    return


def _read_command(reader) -> list[bytes] | None:
    line = reader.readline()
    if not line:
        return None
    assert line[:1] == b"*", line
    args = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        args.append(reader.read(size + 2)[:-2])
    return args


def _object_reply(key: ChunkKey, payload: bytes) -> bytes:
    value = b"".join(encode_streamed(bytes(key), payload, META).pieces())
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.fixture
def fake():
    servers: list[FakeRespServer] = []

    def start(reply: Callable[[int], tuple[list[bytes], str]]) -> FakeRespServer:
        servers.append(FakeRespServer(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_reply_cut_short_is_read_again_on_a_new_connection(fake) -> None:
    key, payload = _key(1), _payload(300_000, 1)
    whole = _object_reply(key, payload)
    server = fake(lambda n: ([whole[: len(whole) // 2]], "close") if n == 1 else ([whole], "keep"))
    tier = _tier(server.url)
    (got,) = tier.get_many([key])
    assert got is not None and bytes(got.payload) == payload
    assert (server.gets, server.connections) == (2, 2)
    assert tier.stats().errors_total == {}


def test_a_reply_cut_short_twice_is_a_counted_miss(fake) -> None:
    key, payload = _key(1), _payload(300_000, 1)
    whole = _object_reply(key, payload)
    server = fake(lambda n: ([whole[:1000]], "close"))
    tier = _tier(server.url)
    assert tier.get_many([key]) == [None]
    assert server.gets == 2
    assert tier.stats().errors_total == {"connection": 1}


def test_a_stalled_reply_is_a_timed_out_miss_and_the_next_read_is_whole(fake) -> None:
    key, payload = _key(1), _payload(300_000, 1)
    whole = _object_reply(key, payload)
    server = fake(lambda n: ([whole[:5000]], "stall") if n == 1 else ([whole], "keep"))
    tier = _tier(server.url, timeout=0.5)
    assert tier.get_many([key]) == [None]
    assert tier.stats().errors_total == {"timeout": 1}
    # The half-read connection was closed, not pooled: the server sees it end,
    # and the next GET goes out on a new connection and reads the value whole.
    assert server.closed_by_client.wait(10)
    (got,) = tier.get_many([key])
    assert got is not None and bytes(got.payload) == payload


@pytest.mark.parametrize(
    ("error", "kind"),
    [(b"-NOPERM this user has no permissions to access the key\r\n", "auth"),
     (b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", "server")],
)  # fmt: skip
def test_an_error_reply_is_a_miss_counted_by_kind(fake, error: bytes, kind: str) -> None:
    server = fake(lambda n: ([error], "keep"))
    tier = _tier(server.url)
    assert tier.get_many([_key(1), _key(2)]) == [None, None]
    assert tier.stats().errors_total == {kind: 1}


# -- get_into: the payload straight into its destination -------------------------


@pytest.mark.parametrize("size", [1, 100, 65_000, 200_000, 3 << 20])
def test_get_into_writes_the_payload_where_place_says(server, size: int) -> None:
    tier = _tier(server.url)
    key, payload = _key(size), _payload(size, 7)
    meta = ChunkMeta(dtype="uint8", shape=(size,))
    assert tier.put(key, payload, meta)
    dest = Destination()
    assert tier.get_into(key, dest) == meta
    assert dest.asked == [(size, meta)]
    assert bytes(dest.buffer) == payload
    stats = tier.stats()
    assert (stats.hits_total, stats.misses_total, stats.corrupt_total) == (1, 0, 0)
    value_bytes = len(redis.Redis.from_url(server.url).get("kvstrata:" + key.hex()))
    assert stats.retrieved_bytes_total == value_bytes


def test_get_into_reads_compressed_and_older_format_objects(server) -> None:
    from kvstrata.sidecar.config import SharedConfig
    from kvstrata.sidecar.objformat import encode_bytes

    zstd_tier = ValkeyTier(SharedConfig(backend="valkey", valkey={"url": server.url}, codec="zstd"))
    payload = b"\x01\x3f" * 50_000  # compressible
    assert zstd_tier.put(_key(1), payload, META)
    raw = redis.Redis.from_url(server.url)
    raw.set("kvstrata:" + _key(2).hex(), encode_bytes(_key(2), payload, META))
    tier = _tier(server.url)
    for key in (_key(1), _key(2)):
        dest = Destination()
        assert tier.get_into(key, dest) == META
        assert bytes(dest.buffer) == payload


def test_get_into_a_corrupt_payload_is_a_counted_miss_and_deleted(server) -> None:
    tier = _tier(server.url)
    key, payload = _key(1), _payload(300_000, 1)
    assert tier.put(key, payload, META)
    raw = redis.Redis.from_url(server.url)
    value = bytearray(raw.get("kvstrata:" + key.hex()))
    value[len(value) // 2] ^= 0x01
    raw.set("kvstrata:" + key.hex(), bytes(value))
    dest = Destination()
    assert tier.get_into(key, dest) is None
    assert len(dest.asked) == 1  # written, then refused: the caller drops what it reserved
    assert (tier.stats().corrupt_total, tier.stats().misses_total) == (1, 1)
    assert raw.exists("kvstrata:" + key.hex()) == 0


def test_get_into_with_nowhere_to_put_it_leaves_the_connection_clean(server) -> None:
    tier = _tier(server.url)
    keys = [_key(1), _key(2)]
    payloads = [_payload(300_000, 1), _payload(200_000, 2)]
    assert tier.put_many([(k, p, META) for k, p in zip(keys, payloads, strict=True)])
    assert tier.get_into(keys[0], Destination(room=False)) is None
    dest = Destination()
    assert tier.get_into(keys[1], dest) == META  # not the rest of the first value
    assert bytes(dest.buffer) == payloads[1]


def test_get_into_a_reply_cut_after_placing_is_a_miss_and_never_placed_twice(fake) -> None:
    key, payload = _key(1), _payload(300_000, 1)
    whole = _object_reply(key, payload)
    server = fake(lambda n: ([whole[: len(whole) // 2]], "close") if n == 1 else ([whole], "keep"))
    tier = _tier(server.url)
    dest = Destination()
    assert tier.get_into(key, dest) is None
    assert len(dest.asked) == 1 and server.gets == 1
    assert tier.stats().errors_total == {"connection": 1}
    again = Destination()  # the next read, on a new connection, is whole
    assert tier.get_into(key, again) == META and bytes(again.buffer) == payload


def test_get_into_a_reply_cut_before_placing_is_read_again(fake) -> None:
    key, payload = _key(1), _payload(300_000, 1)
    whole = _object_reply(key, payload)
    server = fake(lambda n: ([whole[:3]], "close") if n == 1 else ([whole], "keep"))
    tier = _tier(server.url)
    dest = Destination()
    assert tier.get_into(key, dest) == META and bytes(dest.buffer) == payload
    assert (len(dest.asked), server.gets) == (1, 2)
