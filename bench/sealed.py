"""``kvstrata bench remote``'s encryption rows: each tier sealed against itself plain.

For Valkey, S3 and the L2 disk tier, the same timed operations as the tier
rows of :mod:`.remote` (put and get, serial and in batches, interleaved
reps, the first side alternating), where the "tier" side seals every object
(AES-256-GCM, one key) and the baseline is the same tier on the same server
without keys, under a prefix (or folder) of its own. ``ratio`` is sealed /
plain: the throughput kept with encryption on (issue 40's target: at least
0.95).

Besides one thread (``serial``, ``batch8``), each size has a ``writersN``
row: N threads each putting one chunk at a time, then getting them, N being
the tier's default ``writer_threads`` (:data:`WRITERS`), as the sidecar's
write-behind writes (:class:`~kvstrata.sidecar.tiers.base.WriteBehindQueue`:
each worker thread puts one job after another). With one writer, the time
the cipher takes is time the disk or the server waits; with the sidecar's
writers, one thread seals while another's write is on its way.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from kvstrata.bench import remote
from kvstrata.sidecar.config import L2Config, SharedConfig
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.sealing import KeyRing
from kvstrata.sidecar.tiers import s3 as s3_tier
from kvstrata.sidecar.tiers import valkey as valkey_tier
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.testing.keyfolder import MountedSecret, key_files
from kvstrata.testing.servers import MotoS3Server, RedisServer

TARGET_RATIO = 0.95

# The write-behind threads a tier writes with by default (the sidecar's config).
WRITERS = {
    "l2": L2Config.model_fields["writer_threads"].default,
    "shared": SharedConfig.model_fields["writer_threads"].default,
}


def _key_of(name: str) -> ChunkKey:
    """The chunk key :mod:`.remote` named ``raw:<hex>`` for its baseline side."""
    return ChunkKey(bytes.fromhex(name.split(":", 1)[1]))


def _meta(size: int) -> ChunkMeta:
    return ChunkMeta(dtype="bfloat16", shape=(size // 2,))


def _plain_ops(sealed: Tier, plain: Tier) -> remote._Ops:
    """:class:`remote._Ops` whose baseline is ``plain``, the same tier without keys."""

    def put(name: str, data: bytes) -> None:
        if not plain.put(_key_of(name), data, _meta(len(data))):
            raise RuntimeError("plain tier put failed during the benchmark")

    def get(name: str) -> bytes | None:
        obj = plain.get(_key_of(name))
        return None if obj is None else bytes(obj.payload)

    def put_batch(items: list[tuple[str, bytes]]) -> None:
        batch = [(_key_of(n), d, _meta(len(d))) for n, d in items]
        if not all(plain.put_many(batch)):
            raise RuntimeError("plain tier put failed during the benchmark")

    def get_batch(names: list[str]) -> list[Any]:
        return [
            None if o is None else o.payload for o in plain.get_many([_key_of(n) for n in names])
        ]

    ops = remote._Ops(sealed, put, get, plain.clear)
    ops.raw_put_batch, ops.raw_get_batch = put_batch, get_batch
    return ops


def _rows(sealed: Tier, plain: Tier, params: dict[str, Any], writers: int) -> list[dict[str, Any]]:
    ops = _plain_ops(sealed, plain)
    rows: list[dict[str, Any]] = []
    try:
        remote._warm_up(ops)
        for i, mib in enumerate(params["sizes_mib"]):
            payloads = remote._run_payloads(mib * remote.MiB, params, seed=i)
            rows += remote._measure_size(ops, payloads, params)
            rows.append(_writers_row({"tp": sealed, "rp": plain}, payloads, params, writers))
    finally:
        ops.pool.shutdown()
    # Renamed for what the sides are here: sealed (the "tier" side) and plain.
    return [
        {k.replace("tier_", "sealed_").replace("raw_", "plain_"): v for k, v in row.items()}
        for row in rows
    ]


def _writers_row(
    sides: dict[str, Tier], payloads: list[bytes], params: dict[str, Any], writers: int
) -> dict[str, Any]:
    """Both sides (``tp`` sealed, ``rp`` plain) putting ``payloads`` on
    ``writers`` threads, one chunk per call, then getting them the same way:
    the row of mode ``writers<N>`` (:func:`remote._row`)."""
    meta = ChunkMeta(dtype="bfloat16", shape=(len(payloads[0]) // 2,))
    reps: list[dict[str, tuple[float, float]]] = []
    with cf.ThreadPoolExecutor(writers) as pool:
        for rep in range(params["reps"]):
            timings: dict[str, tuple[float, float]] = {}
            order = list(sides) if rep % 2 else list(reversed(sides))
            for put in order:  # the first side alternates, as in the other rows
                tier, keys = sides[put], remote._keys(len(payloads))
                get = "tg" if put == "tp" else "rg"
                for name, op in ((put, "put"), (get, "get")):
                    timings[name] = remote._timed_cpu(
                        partial(_on_threads, pool, op, tier, keys, payloads, meta)
                    )
                tier.clear()
            reps.append(timings)
    return remote._row(f"writers{writers}", payloads, reps)


def _on_threads(
    pool: cf.ThreadPoolExecutor,
    op: str,
    tier: Tier,
    keys: list[ChunkKey],
    payloads: list[bytes],
    meta: ChunkMeta,
) -> None:
    """Put (or get) one chunk per call for each key, on ``pool``'s threads."""
    if op == "put":
        done = pool.map(lambda kp: tier.put(kp[0], kp[1], meta), zip(keys, payloads, strict=True))
    else:
        done = (obj is not None for obj in pool.map(tier.get, keys))
    if not all(done):
        raise RuntimeError(f"a {op} failed during the benchmark")


def _keys(folder: Path) -> KeyRing:
    MountedSecret(folder).publish(key_files({"bench": os.urandom(32)}, writing="bench"))
    return KeyRing("required", str(folder))


def bench_encryption(
    valkey: RedisServer, moto: MotoS3Server, s3_secrets: Path, params: dict[str, Any]
) -> dict[str, Any]:
    """Sealed / plain rows for Valkey, S3 (single PUTs) and L2 on this machine's disk."""
    out: dict[str, Any] = {
        "target_ratio": TARGET_RATIO,
        # What both sides of every ratio share: nothing differs but the keys.
        "equal_resources": {
            "process": "one (this one), the same thread pool of "
            f"{remote.BATCH} for batches, serial calls on the calling thread, and "
            f"for writers rows {WRITERS['shared']} threads (Valkey, S3) or "
            f"{WRITERS['l2']} (L2), the tier's default writer_threads",
            "servers": "the same redis-server and moto server, prefixes of their own",
            "l2": "the same file system, a folder each, the same capacity",
            "data": "the same distinct bf16 KV-like payloads per size, one per put (128 MiB "
            "in all, past the CPU's cache); runs interleaved, first side alternating",
        },
    }
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-sealed-") as tmp:
        keys = _keys(Path(tmp) / "keys")

        def valkey_config(prefix: str) -> SharedConfig:
            return SharedConfig(
                backend="valkey",
                valkey={"url": valkey.url, "timeout_seconds": 10.0, "key_prefix": prefix},
                lookup_timeout_seconds=1.0,
            )

        sealed = valkey_tier.ValkeyTier(valkey_config("sealed:"), keys=keys)
        plain = valkey_tier.ValkeyTier(valkey_config("plain:"))
        out["valkey"] = _rows(sealed, plain, params, WRITERS["shared"])
        sealed.close()
        plain.close()

        big = max(params["sizes_mib"]) * 2 * remote.MiB

        def s3_config(prefix: str) -> SharedConfig:
            return remote._s3_config(moto, s3_secrets, prefix=prefix, multipart_threshold_bytes=big)

        sealed = s3_tier.S3Tier(s3_config("sealed/"), keys=keys)
        plain = s3_tier.S3Tier(s3_config("plain/"))
        out["s3"] = _rows(sealed, plain, params, WRITERS["shared"])
        sealed.close()
        plain.close()

        capacity = 4 * params["bytes_per_run"] + big
        sealed_l2 = DiskTier(Path(tmp) / "l2-sealed", capacity, keys=keys)
        plain_l2 = DiskTier(Path(tmp) / "l2-plain", capacity)
        out["l2"] = _rows(sealed_l2, plain_l2, params, WRITERS["l2"])
    ratios = [
        r[f"{op}_ratio"] for b in ("valkey", "s3", "l2") for r in out[b] for op in ("put", "get")
    ]
    out["median_ratio"] = round(statistics.median(ratios), 3)
    out["min_ratio"] = min(ratios)
    # Process CPU per byte, sealed less plain: what sealing costs whatever the
    # machine's load (the wall ratios move with other work, this much less).
    for backend in ("valkey", "s3", "l2"):
        for op in ("put", "get"):
            extra = [
                r[f"sealed_{op}_cpu_ns_per_byte"] - r[f"plain_{op}_cpu_ns_per_byte"]
                for r in out[backend]
            ]
            out[f"{backend}_{op}_cpu_extra_ns_per_byte"] = round(statistics.median(extra), 3)
            ratio = [r[f"{op}_ratio"] for r in out[backend]]
            out[f"{backend}_{op}_median_ratio"] = round(statistics.median(ratio), 3)
            # As the sidecar writes: its write-behind threads, one chunk each.
            ratio = [r[f"{op}_ratio"] for r in out[backend] if r["mode"].startswith("writers")]
            out[f"{backend}_{op}_writers_median_ratio"] = round(statistics.median(ratio), 3)
    return out


def format_rows(result: dict[str, Any]) -> list[str]:
    lines = ["encryption at rest: GB/s sealed vs the same tier plain (ratio = sealed/plain)"]
    for backend in ("valkey", "s3", "l2"):
        for r in result[backend]:
            lines.append(
                f"  {backend:>6} {r['size_mib']:>4}Mi {r['mode']:>8}"
                f" put {r['sealed_put_gbps']:.3f}/{r['plain_put_gbps']:.3f} {r['put_ratio']:.2f}"
                f"  get {r['sealed_get_gbps']:.3f}/{r['plain_get_gbps']:.3f} {r['get_ratio']:.2f}"
            )
    for backend in ("valkey", "s3", "l2"):
        lines.append(
            f"  {backend:>6} median ratio put {result[f'{backend}_put_median_ratio']}"
            f" get {result[f'{backend}_get_median_ratio']}; CPU per byte sealed - plain:"
            f" put {result[f'{backend}_put_cpu_extra_ns_per_byte']:+.3f} ns/B,"
            f" get {result[f'{backend}_get_cpu_extra_ns_per_byte']:+.3f} ns/B;"
            f" writers rows put {result[f'{backend}_put_writers_median_ratio']}"
            f" get {result[f'{backend}_get_writers_median_ratio']}"
        )
    lines.append(
        f"  median ratio {result['median_ratio']}, min {result['min_ratio']}"
        f" (target >= {result['target_ratio']})"
    )
    return lines
