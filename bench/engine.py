"""``kvstrata bench engine``: the tiered engine against plain memory and disk.

Measured in one run, each figure the median of ``reps`` repetitions after a
warm-up:

* ``l1.store``: for every chunk ``reserve`` + ``torch.Tensor.copy_`` into the
  slot's arena memory + ``commit``; baseline ``memcpy``: the same copies
  into a preallocated, pre-touched buffer of the same size. L2 is off for
  these rows so background disk writes do not share the cores.
* ``l1.retrieve``: ``acquire`` + ``copy_`` out of the slot + ``release``;
  baseline: the same copies out of a plain buffer.
* ``lookup``: ``lookup`` of a 32k-token prompt (128 chunk keys, all in L1),
  median and p99 over many calls.
* ``l2.retrieve``: a fresh engine on the same L2 directory (L1 empty,
  arena pre-touched) ``acquire``s each chunk (read into the arena slot +
  payload checksum, :mod:`kvstrata.sidecar.tiers.disk`) and copies it out;
  baseline: plain reads of files of the same sizes into a preallocated
  buffer, the way the tier reads: past the page cache (``O_DIRECT``, the
  default ``l2.direct_io``) from the disk itself, the baseline's files
  written back and dropped from the cache first; or, where the filesystem
  has no direct I/O, both page-cache warm (files just written; dropping the
  whole cache needs root).

Shapes: ``8b`` (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per
token, 32 MiB per 256-token chunk) and ``tiny`` (2 layers, 2 heads, head
dim 64: 1 KiB per token), 2048 tokens each (512 with ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvstrata.sidecar.allocator import align_up
from kvstrata.sidecar.config import SidecarConfig, config_from_dict
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers import direct_io

MiB = 1 << 20
CHUNK_TOKENS = 256
SHAPES: dict[str, dict[str, int]] = {
    "8b": {"layers": 32, "kv_heads": 8, "head_dim": 128},
    "tiny": {"layers": 2, "kv_heads": 2, "head_dim": 64},
}
TARGETS = {"store_vs_memcpy": 0.85, "retrieve_vs_memcpy": 0.85, "l2_vs_disk_read": 0.5}
LOOKUP_TARGET_SECONDS = 100e-6


def _params(quick: bool) -> dict[str, Any]:
    return {
        "tokens": 512 if quick else 2048,
        "reps": 3 if quick else 9,
        "lookup_calls": 300 if quick else 3000,
        "lookup_chunks": 128,
    }


def _chunk_bytes(shape: dict[str, int]) -> int:
    # K and V, every layer, 2 bytes per bf16 element
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * CHUNK_TOKENS


def _keys(n: int, tag: str) -> list[ChunkKey]:
    fp = Namespace(model=f"bench-engine-{tag}").fingerprint()
    return [make_key(fp, os.urandom(32)) for _ in range(n)]


def _config(arena_bytes: int, l2_dir: str | None) -> SidecarConfig:
    return config_from_dict(
        {
            "l1": {"size_bytes": arena_bytes, "pin_memory": True},
            "l2": {
                "enabled": l2_dir is not None,
                "path": l2_dir or tempfile.gettempdir(),
                "size_bytes": 4 * arena_bytes,
            },
        }
    )


def _paired(
    base: Callable[[], None],
    engine: Callable[[], None],
    reps: int,
    setup: Callable[[], None] | None = None,
) -> tuple[float, float, float]:
    """Run baseline and engine alternately ``reps`` times after one warm-up
    pair; median seconds of each and the median of per-pair ratios
    (baseline time / engine time), which cancels a noisy neighbour's drift."""
    t_base: list[float] = []
    t_engine: list[float] = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        if setup is not None:
            setup()
        t2 = time.perf_counter()
        engine()
        t3 = time.perf_counter()
        if i:
            t_base.append(t1 - t0)
            t_engine.append(t3 - t2)
    ratio = statistics.median(b / e for b, e in zip(t_base, t_engine, strict=True))
    return statistics.median(t_base), statistics.median(t_engine), round(ratio, 3)


def _median_time(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up run."""
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _l1_rows(shape_name: str, p: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kvstrata.sidecar.engine import StorageManager

    chunk = _chunk_bytes(SHAPES[shape_name])
    n = p["tokens"] // CHUNK_TOKENS
    total = n * chunk
    meta = ChunkMeta("bfloat16", (chunk // 2,))
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    out = torch.empty(total, dtype=torch.uint8)
    plain = torch.zeros(total, dtype=torch.uint8)  # the memcpy baseline's "arena"
    with StorageManager(_config(total + 4 * MiB, None)) as engine:
        arena = torch.frombuffer(engine.arena.buffer, dtype=torch.uint8)
        arena.zero_()  # touch every page once, like the baseline buffer
        keys = _keys(n, shape_name)

        def store() -> None:
            for i, key in enumerate(keys):
                slot = engine.reserve(key, chunk, meta, "bench")
                arena[slot.offset : slot.offset + chunk].copy_(src[i * chunk : (i + 1) * chunk])
                engine.commit(slot)

        def memcpy_store() -> None:
            for i in range(n):
                plain[i * chunk : (i + 1) * chunk].copy_(src[i * chunk : (i + 1) * chunk])

        def retrieve() -> None:
            for i, key in enumerate(keys):
                slot = engine.acquire(key, "bench")
                out[i * chunk : (i + 1) * chunk].copy_(arena[slot.offset : slot.offset + chunk])
                engine.release(slot)

        def memcpy_retrieve() -> None:
            for i in range(n):
                out[i * chunk : (i + 1) * chunk].copy_(plain[i * chunk : (i + 1) * chunk])

        t_memcpy_store, t_store, store_ratio = _paired(
            memcpy_store, store, p["reps"], setup=engine.clear
        )
        t_memcpy_retrieve, t_retrieve, retrieve_ratio = _paired(
            memcpy_retrieve, retrieve, p["reps"]
        )
        intact = bool(torch.equal(out, src))
    row = {
        "chunk_bytes": chunk,
        "chunks": n,
        "bytes": total,
        "store_gbps": _gbps(total, t_store),
        "memcpy_store_gbps": _gbps(total, t_memcpy_store),
        "retrieve_gbps": _gbps(total, t_retrieve),
        "memcpy_retrieve_gbps": _gbps(total, t_memcpy_retrieve),
        "retrieved_bytes_intact": intact,
    }
    row["store_vs_memcpy"] = store_ratio
    row["retrieve_vs_memcpy"] = retrieve_ratio
    return row


def _lookup_row(p: dict[str, Any]) -> dict[str, Any]:
    from kvstrata.sidecar.engine import StorageManager

    n = p["lookup_chunks"]
    meta = ChunkMeta("uint8", (4096,))
    with StorageManager(_config(64 * MiB, None)) as engine:
        keys = _keys(n, "lookup")
        for key in keys:
            engine.put(key, b"\0" * 4096, meta)
        samples = []
        for _ in range(p["lookup_calls"]):
            t0 = time.perf_counter()
            result = engine.lookup(keys)
            samples.append(time.perf_counter() - t0)
        assert result.hit_chunks == n
    samples.sort()
    median = statistics.median(samples)
    return {
        "prompt_tokens": n * CHUNK_TOKENS,
        "chunks": n,
        "calls": len(samples),
        "median_us": round(median * 1e6, 2),
        "p99_us": round(samples[int(0.99 * (len(samples) - 1))] * 1e6, 2),
        "target_median_us": LOOKUP_TARGET_SECONDS * 1e6,
    }


def _disk_read(paths: list[str], into: Any, direct: bool) -> None:
    """Read every file whole into ``into``; ``direct``: the way the L2 tier
    reads it then, past the page cache (``into`` must start on a page)."""
    view = memoryview(into).cast("B")
    offset = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            # O_DIRECT reads whole aligned units; the buffer has room for them.
            want = align_up(size, direct_io.ALIGN) if direct else size
            done = 0
            while done < size:
                n = os.preadv(fd, [view[offset + done : offset + want]], done)
                if n <= 0:
                    break
                done += n
            offset += want
        finally:
            os.close(fd)


def _l2_row(p: dict[str, Any], root: str) -> dict[str, Any]:
    import torch

    chunk = _chunk_bytes(SHAPES["8b"])
    n = p["tokens"] // CHUNK_TOKENS
    total = n * chunk
    plain_dir = os.path.join(root, "plain")
    os.makedirs(plain_dir)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    keys = _keys(n, "l2")
    config = _config(total + 4 * MiB, os.path.join(root, "l2"))
    file_sizes = _fill_l2(config, keys, src, chunk)
    direct = _l2_reads_direct(config)
    paths = _plain_files(plain_dir, file_sizes, direct)
    out = torch.empty(total, dtype=torch.uint8)
    aligned = sum(align_up(n, direct_io.ALIGN) for n in file_sizes)
    disk_buf = mmap.mmap(-1, aligned)  # starts on a page, as O_DIRECT needs
    times_disk, times_promote, times_engine = _timed_l2_reads(
        config, keys, paths, lambda: _disk_read(paths, disk_buf, direct), out, chunk, p["reps"]
    )
    t_disk = statistics.median(times_disk)
    t_engine = statistics.median(times_engine)
    t_promote = statistics.median(times_promote)

    def paired(engine_times: list[float]) -> float:
        pairs = zip(times_disk, engine_times, strict=True)
        return round(statistics.median(d / e for d, e in pairs), 3)

    return {
        "chunk_bytes": chunk,
        "chunks": n,
        "bytes": total,
        "page_cache": (
            "bypassed by both (O_DIRECT reads: L2 files and the baseline's)"
            if direct
            else "warm for both (files just written; no root to drop caches)"
        ),
        "direct_io": direct,
        "promote_gbps": _gbps(total, t_promote),
        "retrieve_with_copy_out_gbps": _gbps(total, t_engine),
        "disk_read_gbps": _gbps(sum(file_sizes), t_disk),
        "l2_vs_disk_read": paired(times_promote),
        "l2_with_copy_out_vs_disk_read": paired(times_engine),
        "retrieved_bytes_intact": bool(torch.equal(out, src)),
        "directory_filesystem": _filesystem_of(root),
    }


def _fill_l2(config: SidecarConfig, keys: list[ChunkKey], src: Any, chunk: int) -> list[int]:
    """Store ``src`` chunk by chunk and wait until L2 holds every chunk; the
    sizes of their L2 files (the baseline reads files of the same sizes)."""
    from kvstrata.sidecar.engine import StorageManager

    meta = ChunkMeta("bfloat16", (chunk // 2,))
    with StorageManager(config) as engine:
        for i, key in enumerate(keys):
            engine.put(key, memoryview(src[i * chunk : (i + 1) * chunk].numpy()), meta)
        if not engine.flush(120):
            raise RuntimeError("L2 writes did not finish within 120 s")
        return [os.path.getsize(engine.l2.path_of(k)) for k in keys]


def _l2_reads_direct(config: SidecarConfig) -> bool:
    """Whether the L2 tier of ``config`` reads past the page cache here."""
    return config.l2.direct_io and direct_io.supported(config.l2.path)


def _plain_files(directory: str, sizes: list[int], direct: bool) -> list[str]:
    """One file of random bytes per size, for the plain disk-read baseline;
    ``direct``: kept out of the page cache, as the L2 tier's files are."""
    paths = []
    for i, size in enumerate(sizes):
        path = os.path.join(directory, f"{i}.bin")
        with open(path, "wb") as fh:
            fh.write(os.urandom(size))
            if direct:  # written back, then dropped from the cache (no root needed)
                fh.flush()
                os.fsync(fh.fileno())
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        paths.append(path)
    return paths


def _timed_l2_reads(
    config: SidecarConfig,
    keys: list[ChunkKey],
    paths: list[str],
    disk_read: Callable[[], None],
    out: Any,
    chunk: int,
    reps: int,
) -> tuple[list[float], list[float], list[float]]:
    """``reps`` paired rounds (after one warm-up) of the plain disk read and of
    a restarted engine's promotion from L2 then copy out into ``out``; the
    seconds (disk read, promotion, promotion + copy out) of each round."""
    import torch

    from kvstrata.sidecar.engine import StorageManager

    times_disk: list[float] = []
    times_engine: list[float] = []
    times_promote: list[float] = []
    for i in range(reps + 1):  # baseline and engine alternate, paired
        t0 = time.perf_counter()
        disk_read()
        t_disk = time.perf_counter() - t0
        with StorageManager(config) as engine:  # a restart: L1 empty, L2 re-indexed
            arena = torch.frombuffer(engine.arena.buffer, dtype=torch.uint8)
            arena.zero_()  # pre-touched, like the baseline's buffer
            t0 = time.perf_counter()
            slots = [engine.acquire(key, "bench") for key in keys]
            t1 = time.perf_counter()
            for j, slot in enumerate(slots):
                out[j * chunk : (j + 1) * chunk].copy_(arena[slot.offset : slot.offset + chunk])
                engine.release(slot)
            t2 = time.perf_counter()
            del arena
        if i:
            times_disk.append(t_disk)
            times_promote.append(t1 - t0)
            times_engine.append(t2 - t0)
    return times_disk, times_promote, times_engine


def _filesystem_of(path: str) -> str:
    best, fstype = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    p = _params(bool(getattr(args, "quick", False)))
    threads = torch.get_num_threads()
    # One copy thread for engine and baseline alike: on a small shared box
    # OpenMP's spin barriers turn a 256 KiB copy into milliseconds.
    torch.set_num_threads(1)
    try:
        return _run(p)
    finally:
        torch.set_num_threads(threads)


def _run(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {
        "params": p,
        "torch_threads": torch.get_num_threads(),
        "shapes": {name: {**SHAPES[name], "dtype": "bfloat16"} for name in SHAPES},
        "targets": {**TARGETS, "lookup_median_us": LOOKUP_TARGET_SECONDS * 1e6},
    }
    result["l1"] = {name: _l1_rows(name, p) for name in SHAPES}
    result["lookup"] = _lookup_row(p)
    root = tempfile.mkdtemp(prefix="kvstrata-bench-engine-")
    try:
        result["l2"] = _l2_row(p, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    eight = result["l1"]["8b"]
    result["meets_targets"] = {
        "store": eight["store_vs_memcpy"] >= TARGETS["store_vs_memcpy"],
        "retrieve": eight["retrieve_vs_memcpy"] >= TARGETS["retrieve_vs_memcpy"],
        "lookup": result["lookup"]["median_us"] <= LOOKUP_TARGET_SECONDS * 1e6,
        "l2": result["l2"]["l2_vs_disk_read"] >= TARGETS["l2_vs_disk_read"],
    }
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'shape':<6} {'chunk':>9} {'store':>8} {'memcpy':>8} {'ratio':>6}"
        f" {'retrieve':>9} {'memcpy':>8} {'ratio':>6}   (GB/s)"
    ]
    for name, row in result["l1"].items():
        lines.append(
            f"{name:<6} {row['chunk_bytes'] // 1024:>7}Ki {row['store_gbps']:>8.2f}"
            f" {row['memcpy_store_gbps']:>8.2f} {row['store_vs_memcpy']:>6.2f}"
            f" {row['retrieve_gbps']:>9.2f} {row['memcpy_retrieve_gbps']:>8.2f}"
            f" {row['retrieve_vs_memcpy']:>6.2f}"
        )
    lk = result["lookup"]
    lines.append(
        f"lookup of {lk['prompt_tokens']} tokens ({lk['chunks']} chunks):"
        f" median {lk['median_us']} us, p99 {lk['p99_us']} us"
    )
    l2 = result["l2"]
    lines.append(
        f"L2 promote {l2['promote_gbps']:.2f} GB/s"
        f" (+ copy out {l2['retrieve_with_copy_out_gbps']:.2f})"
        f" vs plain disk read {l2['disk_read_gbps']:.2f} GB/s:"
        f" {l2['l2_vs_disk_read']:.2f}x ({l2['l2_with_copy_out_vs_disk_read']:.2f}x)"
        f" [{l2['page_cache']}; {l2['directory_filesystem']}]"
    )
    lines.append(f"meets targets: {result['meets_targets']}")
    return "\n".join(lines)
