"""``kvstrata bench remote``: the shared tiers against their raw clients.

Starts its own loopback ``valkey-server``/``redis-server`` and moto S3
server (:mod:`kvstrata.testing.servers`), then for each chunk size measures
put and get throughput of

* ``tier``: :class:`ValkeyTier` / :class:`S3Tier` (object header, xxh3
  checksums, dedup check, breaker, deadlines), and
* ``raw``: the same client library doing the same operations with the same
  connection settings (redis-py SET/GET of the payload bytes, boto3
  put_object/get_object; the S3 tier is set to single PUTs for these rows,
  and ``multipart_rows`` show its default multipart path for chunks of
  16 MiB and more against the same raw single PUT),

one chunk at a time (``serial``) and ``batch`` chunks at once (tier:
``put_many`` / ``get_many``; raw: one pipeline for Valkey, that many
concurrent calls for S3). Every figure is the median over
``reps`` interleaved runs; ``ratio`` is the median of tier / raw per run
(each tier run paired with the raw run beside it; which of the two goes
first alternates from run to run, so neither always meets the server
right after the other's writes). Next to the wall-clock ratios each row
has the process CPU time per byte of both sides (``*_cpu_ns_per_byte``,
all threads of this process): on a machine shared with other work the
wall ratios move with the load, the CPU cost per byte much less. The run
records the load average when it starts (before its own servers) and the
CPU the rest of the machine used while it ran (``other_work_cores``: all
CPU time in ``/proc/stat`` less this process's and its servers'); a run
that started above :data:`QUIET_LOAD` or competed with more than
:data:`QUIET_OTHER_CORES` of other work is marked as not a measurement.
It also measures a 64-key existence lookup and the optional codecs on
bf16 KV-like data, and each tier with encryption at rest against itself
without (:mod:`.sealed`, same servers, same run).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.bench.kvdata import bf16_kv_like
from kvstrata.sidecar.codecs import compress, decompress
from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers import s3 as s3_tier
from kvstrata.sidecar.tiers import valkey as valkey_tier
from kvstrata.sidecar.tiers import valkey_client
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.s3client import make_client
from kvstrata.testing.servers import MotoS3Server, RedisServer, redis_server_binary

MiB = 1 << 20
BATCH = 8
# Targets of the tier against the raw client (issue 24): every cell, and the
# median of a backend's cells.
TARGET_CELL_RATIO = 0.85
TARGET_MEDIAN_RATIO = 0.95
# A 1-minute load average above this when the run starts, or other work using
# more than QUIET_OTHER_CORES cores on average while it runs, means other work
# competed for the cores: the run's ratios are noise, not a measurement.
QUIET_LOAD = 1.5
QUIET_OTHER_CORES = 0.5
NS = Namespace(model="bench-remote").fingerprint()


PARTS = ("all", "encryption")


def _params(quick: bool) -> dict[str, Any]:
    return {
        "sizes_mib": [1, 4] if quick else [1, 4, 16, 32],
        "reps": 2 if quick else 5,
        "bytes_per_run": (16 if quick else 128) * MiB,
        "batch": BATCH,
        "parts": "all",
    }


def plan_from(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings: :func:`_params` with ``--param`` applied.

    ``parts=encryption`` runs only the sealed-against-plain rows (:mod:`.sealed`),
    which a run repeated to see its spread needs without the rest;
    ``sizes_mib=1,4,16`` and ``reps=N`` set the chunk sizes and the runs per cell.
    """
    params = _params(bool(getattr(args, "quick", False)))
    for item in getattr(args, "param", None) or []:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError("expected KEY=VALUE")
            if key == "parts":
                if value not in PARTS:
                    raise ValueError(f"one of {', '.join(PARTS)}")
                params["parts"] = value
            elif key == "sizes_mib":
                sizes = [int(v) for v in value.split(",")]
                if not sizes or not all(1 <= v <= 64 for v in sizes):
                    raise ValueError("sizes between 1 and 64 MiB")
                params["sizes_mib"] = sizes
            elif key == "reps":
                params["reps"] = int(value)
                if not 1 <= params["reps"] <= 50:
                    raise ValueError("between 1 and 50")
            else:
                raise ValueError("KEY one of parts, reps, sizes_mib")
        except ValueError as exc:
            raise SystemExit(f"--param {item!r}: {exc}") from None
    return params


def _keys(n: int) -> list[ChunkKey]:
    return [make_key(NS, os.urandom(32)) for _ in range(n)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _timed_cpu(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (every thread of this process) of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _in_batches(items: list[Any], fn: Callable[[list[Any]], None]) -> None:
    for i in range(0, len(items), BATCH):
        fn(items[i : i + BATCH])


# -- one backend ----------------------------------------------------------


class _Ops:
    """The eight timed operations of one backend at one chunk size."""

    def __init__(
        self, tier: Tier, raw_put: Callable, raw_get: Callable, raw_clear: Callable
    ) -> None:
        self.tier = tier
        self.raw_put_one, self.raw_get_one, self.raw_clear = raw_put, raw_get, raw_clear
        self.raw_put_batch: Callable[[list[tuple[str, bytes]]], None] | None = None
        self.raw_get_batch: Callable[[list[str]], None] | None = None
        self.pool = cf.ThreadPoolExecutor(BATCH)

    def tier_put(
        self, keys: list[ChunkKey], payloads: list[bytes], meta: ChunkMeta, batched: bool
    ) -> None:
        items = [(k, data, meta) for k, data in zip(keys, payloads, strict=True)]
        ok: list[bool] = []
        if batched:
            _in_batches(items, lambda b: ok.extend(self.tier.put_many(b)))
        else:
            ok = [self.tier.put(*item) for item in items]
        if not all(ok):
            raise RuntimeError("tier put failed during the benchmark")

    def tier_get(self, keys: list[ChunkKey], size: int, batched: bool) -> None:
        got: list[Any] = []
        if batched:
            _in_batches(keys, lambda b: got.extend(self.tier.get_many(b)))
        else:
            got = [self.tier.get(k) for k in keys]
        if any(g is None or len(g.payload) != size for g in got):
            raise RuntimeError("tier get missed during the benchmark")

    def raw_put(self, names: list[str], payloads: list[bytes], batched: bool) -> None:
        items = list(zip(names, payloads, strict=True))
        if not batched:
            for name, data in items:
                self.raw_put_one(name, data)
        elif self.raw_put_batch is not None:
            _in_batches(items, self.raw_put_batch)
        else:
            list(self.pool.map(lambda item: self.raw_put_one(*item), items))

    def raw_get(self, names: list[str], size: int, batched: bool) -> None:
        if not batched:
            got = [self.raw_get_one(n) for n in names]
        elif self.raw_get_batch is not None:
            got = []
            _in_batches(names, lambda b: got.extend(self.raw_get_batch(b)))
        else:
            got = list(self.pool.map(self.raw_get_one, names))
        if any(g is None or len(g) != size for g in got):
            raise RuntimeError("raw get missed during the benchmark")


def _one_rep(
    ops: _Ops, payloads: list[bytes], meta: ChunkMeta, batched: bool, tier_first: bool = False
) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds of raw put, tier put, raw get, tier get on fresh
    keys, one key per payload.

    Puts run as a pair, then gets as a pair; ``tier_first`` says which side
    of each pair goes first.
    """
    keys = _keys(len(payloads))
    names = [f"raw:{k.hex()}" for k in keys]
    size = len(payloads[0])
    puts = [
        ("rp", lambda: ops.raw_put(names, payloads, batched)),
        ("tp", lambda: ops.tier_put(keys, payloads, meta, batched)),
    ]
    gets = [
        ("rg", lambda: ops.raw_get(names, size, batched)),
        ("tg", lambda: ops.tier_get(keys, size, batched)),
    ]
    out: dict[str, tuple[float, float]] = {}
    for pair in (puts, gets):
        for name, fn in reversed(pair) if tier_first else pair:
            out[name] = _timed_cpu(fn)
    ops.tier.clear()
    ops.raw_clear()
    return out


def _warm_up(ops: _Ops) -> None:
    """One unrecorded round (connections, allocator, server) before measuring."""
    payloads = _payloads(MiB, BATCH, seed=123)
    for batched in (False, True):
        _one_rep(ops, payloads, ChunkMeta(dtype="bfloat16", shape=(MiB // 2,)), batched)


def _payloads(size: int, count: int, seed: int) -> list[bytes]:
    """``count`` distinct bf16 KV-like payloads of ``size`` bytes.

    Every put of a run sends a payload of its own, as the sidecar's puts
    each send their own L1 slot: one payload sent ``count`` times would
    stay in the CPU's cache after the first put, which made the plain copy
    of a 1-4 MiB chunk cheaper than it is in service (and anything the
    tier does per byte, hashing or sealing, look dearer beside it). The
    run's payloads together (``bytes_per_run``, 128 MiB) are well past the
    last-level cache of the machines measured (32 MiB on the AMD EPYC VM).
    """
    first = bf16_kv_like(size, seed=seed)
    rng = np.random.default_rng(seed)
    # The same values in another order for each: as compressible as the
    # first (the codecs' figures depend on it) and cheap to make.
    words = np.frombuffer(first, dtype=np.uint16)
    return [first] + [rng.permutation(words).tobytes() for _ in range(count - 1)]


def _run_payloads(size: int, params: dict[str, Any], seed: int) -> list[bytes]:
    """The payloads of one chunk size's runs: ``bytes_per_run`` of them, at
    least a batch."""
    return _payloads(size, max(BATCH, params["bytes_per_run"] // size), seed)


def _measure_size(ops: _Ops, payloads: list[bytes], params: dict[str, Any]) -> list[dict]:
    """The serial and the batched row of one chunk size, each run putting ``payloads``."""
    meta = ChunkMeta(dtype="bfloat16", shape=(len(payloads[0]) // 2,))
    rows = []
    for batched in (False, True):
        reps = [
            _one_rep(ops, payloads, meta, batched, tier_first=rep % 2 == 1)
            for rep in range(params["reps"])
        ]
        rows.append(_row(f"batch{BATCH}" if batched else "serial", payloads, reps))
    return rows


def _row(
    mode: str, payloads: list[bytes], reps: list[dict[str, tuple[float, float]]]
) -> dict[str, Any]:
    """One row from the runs of a mode: each run's wall and CPU seconds of
    raw put ``rp``, tier put ``tp``, raw get ``rg`` and tier get ``tg``, all
    of ``payloads``."""
    size = len(payloads[0])
    total = size * len(payloads)
    samples = {k: [_gbps(total, rep[k][0]) for rep in reps] for k in ("tp", "tg", "rp", "rg")}
    cpu = {
        k: round(statistics.median(rep[k][1] / total * 1e9 for rep in reps), 3)
        for k in ("tp", "tg", "rp", "rg")
    }
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Ratios pair each tier run with the raw run next to it, so load from
    # other processes during one rep moves both sides of a ratio.
    put_ratio = statistics.median(t / r for t, r in zip(samples["tp"], samples["rp"], strict=True))
    get_ratio = statistics.median(t / r for t, r in zip(samples["tg"], samples["rg"], strict=True))
    return {
        "size_mib": size // MiB,
        "mode": mode,
        "chunks": len(payloads),
        "tier_put_gbps": round(med["tp"], 3),
        "raw_put_gbps": round(med["rp"], 3),
        "put_ratio": round(put_ratio, 3),
        "tier_get_gbps": round(med["tg"], 3),
        "raw_get_gbps": round(med["rg"], 3),
        "get_ratio": round(get_ratio, 3),
        "tier_put_cpu_ns_per_byte": cpu["tp"],
        "raw_put_cpu_ns_per_byte": cpu["rp"],
        "tier_get_cpu_ns_per_byte": cpu["tg"],
        "raw_get_cpu_ns_per_byte": cpu["rg"],
    }


def _lookup_ms(tier: Tier, raw_lookup: Callable[[list[str]], Any], reps: int = 30) -> dict:
    keys = _keys(64)
    for key in keys[::2]:
        tier.put(key, b"\0" * 64, ChunkMeta())
    names = [f"raw:{k.hex()}" for k in keys]
    tier_ms = [1000 * _timed(lambda: tier.contains_many(keys)) for _ in range(reps)]
    raw_ms = [1000 * _timed(lambda: raw_lookup(names)) for _ in range(reps)]
    tier.clear()
    return {
        "keys": len(keys),
        "tier_p50_ms": round(statistics.median(tier_ms), 3),
        "raw_p50_ms": round(statistics.median(raw_ms), 3),
    }


def bench_valkey(server: RedisServer, params: dict[str, Any]) -> dict[str, Any]:
    config = SharedConfig(
        backend="valkey",
        valkey={"url": server.url, "timeout_seconds": 10.0},
        lookup_timeout_seconds=1.0,
    )
    tier = valkey_tier.ValkeyTier(config)
    # Raw baseline: the same library and connection settings, plain SET/GET.
    raw = valkey_client.make_client(config.valkey, timeout=10.0, pool_size=16)

    def raw_put_batch(items: list[tuple[str, bytes]]) -> None:
        pipe = raw.pipeline(transaction=False)
        for name, data in items:
            pipe.set(name, data)
        pipe.execute()

    def raw_get_batch(names: list[str]) -> list[bytes]:
        pipe = raw.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def raw_exists(names: list[str]) -> list[int]:
        pipe = raw.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return pipe.execute()

    ops = _Ops(tier, raw.set, raw.get, raw.flushdb)
    ops.raw_put_batch, ops.raw_get_batch = raw_put_batch, raw_get_batch
    _warm_up(ops)
    rows: list[dict] = []
    for i, mib in enumerate(params["sizes_mib"]):
        rows += _measure_size(ops, _run_payloads(mib * MiB, params, seed=i), params)
    out = {"rows": rows, "lookup": _lookup_ms(tier, raw_exists)}
    out["zstd_4mib"] = _codec_through_tier(server, params)
    ops.pool.shutdown()
    tier.close()
    raw.close()
    return out


def _codec_through_tier(server: RedisServer, params: dict[str, Any]) -> dict[str, Any]:
    """Serial put/get of 4 MiB bf16 chunks through the Valkey tier with zstd on."""
    config = SharedConfig(
        backend="valkey", valkey={"url": server.url, "timeout_seconds": 10.0}, codec="zstd"
    )
    tier = valkey_tier.ValkeyTier(config)
    size, data = 4 * MiB, bf16_kv_like(4 * MiB, seed=99)
    meta = ChunkMeta(dtype="bfloat16", shape=(size // 2,))
    keys = _keys(max(4, params["bytes_per_run"] // size // 2))
    total = len(keys) * size
    put_s = _timed(lambda: [tier.put(k, data, meta) for k in keys])
    get_s = _timed(lambda: [tier.get(k) for k in keys])
    stored = tier.stats().stored_bytes_total
    tier.clear()
    tier.close()
    return {
        "put_gbps": round(_gbps(total, put_s), 3),
        "get_gbps": round(_gbps(total, get_s), 3),
        "stored_ratio": round(total / stored, 3),
    }


def _s3_config(server: MotoS3Server, secrets: Path, **s3: Any) -> SharedConfig:
    """The S3 tier's config on ``server``, its credentials written under ``secrets``."""
    (secrets / "id").write_text("bench")
    (secrets / "secret").write_text("bench-secret")
    return SharedConfig(
        backend="s3",
        s3={
            "endpoint_url": server.endpoint_url,
            "bucket": "kvstrata-bench",
            "create_bucket": True,
            "access_key_id_file": str(secrets / "id"),
            "secret_access_key_file": str(secrets / "secret"),
            "timeout_seconds": 60.0,
            **s3,
        },
        lookup_timeout_seconds=5.0,
    )


def bench_s3(server: MotoS3Server, secrets: Path, params: dict[str, Any]) -> dict[str, Any]:
    """S3 rows: single PUTs like the raw client; then the multipart path at >= 16 MiB."""
    config = _s3_config(
        server, secrets, multipart_threshold_bytes=max(params["sizes_mib"]) * 2 * MiB
    )
    tier = s3_tier.S3Tier(config)
    raw = make_client(config.s3)  # same boto3 settings, plain calls
    bucket = config.s3.bucket

    def raw_get(name: str) -> bytes:
        return raw.get_object(Bucket=bucket, Key=name)["Body"].read()

    def raw_clear() -> None:
        for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="raw:"):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                raw.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})

    def raw_heads(names: list[str]) -> list[bool]:
        def head(name: str) -> bool:
            try:
                raw.head_object(Bucket=bucket, Key=name)
                return True
            except raw.exceptions.ClientError:
                return False

        return list(ops.pool.map(head, names))

    def raw_put(name: str, data: bytes) -> None:
        raw.put_object(Bucket=bucket, Key=name, Body=data)

    ops = _Ops(tier, raw_put, raw_get, raw_clear)
    _warm_up(ops)
    rows: list[dict] = []
    for i, mib in enumerate(params["sizes_mib"]):
        rows += _measure_size(ops, _run_payloads(mib * MiB, params, seed=i), params)
    out: dict[str, Any] = {"rows": rows, "lookup": _lookup_ms(tier, raw_heads, reps=10)}
    ops.pool.shutdown()
    tier.close()

    # The default config uploads objects above 16 MiB in 8 MiB parts.
    multipart = s3_tier.S3Tier(_s3_config(server, secrets))
    mp_ops = _Ops(multipart, raw_put, raw_get, raw_clear)
    out["multipart_rows"] = [
        row
        for i, mib in enumerate(params["sizes_mib"])
        if mib * MiB >= config.s3.multipart_chunk_bytes * 2
        for row in _measure_size(mp_ops, _run_payloads(mib * MiB, params, seed=i), params)
    ]
    mp_ops.pool.shutdown()
    multipart.close()
    return out


def bench_codecs(size: int = 4 * MiB, reps: int = 3) -> list[dict[str, Any]]:
    """Ratio and single-thread speed of each codec on bf16 KV-like data."""
    data = bf16_kv_like(size, seed=1)
    rows = []
    for codec in ("zstd", "lz4"):
        packed = compress(codec, data)
        c_s = min(_timed(lambda c=codec: compress(c, data)) for _ in range(reps))
        d_s = min(_timed(lambda c=codec, p=packed: decompress(c, p, size)) for _ in range(reps))
        rows.append(
            {
                "codec": codec,
                "input_mib": size // MiB,
                "ratio": round(size / len(packed), 3),
                "compress_mbps": round(size / c_s / 1e6, 1),
                "decompress_mbps": round(size / d_s / 1e6, 1),
            }
        )
    return rows


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "target_cell_ratio": TARGET_CELL_RATIO,
        "target_median_ratio": TARGET_MEDIAN_RATIO,
    }
    met = True
    for backend in ("valkey", "s3"):
        rows = result[backend]["rows"]
        ratios = [r["put_ratio"] for r in rows] + [r["get_ratio"] for r in rows]
        out[f"{backend}_min_put_ratio"] = min(r["put_ratio"] for r in rows)
        out[f"{backend}_min_get_ratio"] = min(r["get_ratio"] for r in rows)
        out[f"{backend}_median_ratio"] = round(statistics.median(ratios), 3)
        # CPU per byte, raw / tier (above 1: the tier spends less than the raw client).
        cpu = [
            r[f"raw_{op}_cpu_ns_per_byte"] / r[f"tier_{op}_cpu_ns_per_byte"]
            for r in rows
            for op in ("put", "get")
            if r[f"tier_{op}_cpu_ns_per_byte"] > 0
        ]
        out[f"{backend}_median_cpu_ratio"] = round(statistics.median(cpu), 3) if cpu else None
        met = met and min(ratios) >= TARGET_CELL_RATIO
        met = met and out[f"{backend}_median_ratio"] >= TARGET_MEDIAN_RATIO
    out.update(_quiet(result))
    out["targets_met"] = met
    return out


def _quiet(result: dict[str, Any]) -> dict[str, Any]:
    """Whether the machine was quiet enough for the wall ratios to be a measurement."""
    load = result.get("load_average", {})
    other = load.get("other_work_cores")
    quiet = load.get("start", 0.0) <= QUIET_LOAD and (other is None or other <= QUIET_OTHER_CORES)
    return {"quiet": quiet}


def _load_1min() -> float:
    return round(os.getloadavg()[0], 2)


def _machine_busy_seconds() -> float | None:
    """CPU seconds every process of the machine has used since boot (Linux
    ``/proc/stat``: user, nice, system, irq, softirq and steal); None elsewhere."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(t) for t in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (the servers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(args: argparse.Namespace) -> dict[str, Any]:
    params = plan_from(args)
    everything = params["parts"] == "all"
    load_start = _load_1min()
    busy_start, own_start, wall_start = _machine_busy_seconds(), _own_cpu_seconds(), time.time()
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-remote-") as tmp:
        base = Path(tmp)
        # moto writes objects above about 5 MiB to temporary files; the VM's
        # page-cache writeback then lands on whichever side of a pair runs at
        # the time. Both sides measure the same server, kept in memory here.
        in_memory = 2 * max(params["sizes_mib"]) * MiB
        with (
            RedisServer(base / "valkey") as valkey_server,
            MotoS3Server(memory_object_bytes=in_memory) as moto,
        ):
            result: dict[str, Any] = {
                "params": params,
                "servers": {
                    "valkey": os.path.basename(redis_server_binary()),
                    "s3": f"moto_server (loopback, child process; objects up to "
                    f"{in_memory // MiB} MiB kept in memory)",
                },
            }
            if everything:
                result["valkey"] = bench_valkey(valkey_server, params)
                result["s3"] = bench_s3(moto, base, params)
            from kvstrata.bench.sealed import bench_encryption

            result["encryption"] = bench_encryption(valkey_server, moto, base, params)
    if everything:
        result["codecs"] = bench_codecs()
    busy_end, wall = _machine_busy_seconds(), time.time() - wall_start
    other = None
    if busy_start is not None and busy_end is not None and wall > 0:
        own = _own_cpu_seconds() - own_start
        other = round(max(0.0, busy_end - busy_start - own) / wall, 2)
    result["load_average"] = {
        "start": load_start,
        "end": _load_1min(),
        "quiet_below": QUIET_LOAD,
        "other_work_cores": other,
        "quiet_other_cores_below": QUIET_OTHER_CORES,
    }
    result["summary"] = _summary(result) if everything else _quiet(result)
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = _format_tiers(result) if "valkey" in result else []
    if "encryption" in result:
        from kvstrata.bench.sealed import format_rows

        lines += format_rows(result["encryption"])
    load, quiet = result["load_average"], result["summary"]["quiet"]
    lines.append(
        f"load average (1 min): {load['start']} at start, {load['end']} at end (with this run);"
        f" other work used {load['other_work_cores']} cores on average while it ran"
        + ("" if quiet else ": NOT a measurement (other work competed for the cores)")
    )
    return "\n".join(lines)


def _format_tiers(result: dict[str, Any]) -> list[str]:
    lines = []
    for backend in ("valkey", "s3"):
        lines.append(f"{backend}: GB/s (tier vs raw client, median of {result['params']['reps']})")
        lines.append(
            f"  {'size':>6} {'mode':>7} {'put tier':>9} {'raw':>7} {'ratio':>6}"
            f" {'get tier':>9} {'raw':>7} {'ratio':>6}   CPU ns/B put tier/raw, get tier/raw"
        )
        for r in result[backend]["rows"]:
            lines.append(
                f"  {r['size_mib']:>4}Mi {r['mode']:>7} {r['tier_put_gbps']:>9.3f}"
                f" {r['raw_put_gbps']:>7.3f} {r['put_ratio']:>6.2f} {r['tier_get_gbps']:>9.3f}"
                f" {r['raw_get_gbps']:>7.3f} {r['get_ratio']:>6.2f}"
                f"   {r['tier_put_cpu_ns_per_byte']:.3f}/{r['raw_put_cpu_ns_per_byte']:.3f},"
                f" {r['tier_get_cpu_ns_per_byte']:.3f}/{r['raw_get_cpu_ns_per_byte']:.3f}"
            )
        for r in result[backend].get("multipart_rows", []):
            lines.append(
                f"  {r['size_mib']:>4}Mi {r['mode']:>7} {r['tier_put_gbps']:>9.3f}"
                f" {r['raw_put_gbps']:>7.3f} {r['put_ratio']:>6.2f}   (multipart upload, 8Mi parts)"
            )
        lk = result[backend]["lookup"]
        lines.append(
            f"  lookup of {lk['keys']} keys: tier {lk['tier_p50_ms']} ms, raw {lk['raw_p50_ms']} ms"
        )
    z = result["valkey"]["zstd_4mib"]
    lines.append(
        f"valkey tier with zstd, 4Mi bf16: put {z['put_gbps']} GB/s, get {z['get_gbps']} GB/s,"
        f" stored ratio {z['stored_ratio']}"
    )
    lines.append("codecs on bf16 KV-like data (one thread):")
    for c in result["codecs"]:
        lines.append(
            f"  {c['codec']:>5}: ratio {c['ratio']:.3f}, compress {c['compress_mbps']} MB/s,"
            f" decompress {c['decompress_mbps']} MB/s"
        )
    s = result["summary"]
    lines.append(
        f"min ratio tier/raw: valkey put {s['valkey_min_put_ratio']} get"
        f" {s['valkey_min_get_ratio']}; s3 put {s['s3_min_put_ratio']} get {s['s3_min_get_ratio']}"
        f" (target every cell >= {s['target_cell_ratio']})"
    )
    lines.append(
        f"median ratio: valkey {s['valkey_median_ratio']}, s3 {s['s3_median_ratio']}"
        f" (target >= {s['target_median_ratio']}); median CPU raw/tier: valkey"
        f" {s['valkey_median_cpu_ratio']}, s3 {s['s3_median_cpu_ratio']}"
    )
    return lines
