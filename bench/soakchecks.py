"""The soak's checks: plain functions of what was observed, each naming what broke.

Why plain functions: each check must be able to fail, and a test shows it
failing on real observations with the defect it guards against injected
(``kvstrata bench soak --inject-defect NAME``, tests/bench/test_bench_soak.py).
Each returns a list of problems; empty means the check passed.
"""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    index: int
    prompt: int  # index into the prompt list
    status: int  # HTTP status of the final attempt (0: no answer)
    tokens: tuple[int, ...]
    error: str = ""
    retried_in_vllm_restart: int = 0


@dataclass(frozen=True)
class Bounds:
    """How far the sidecar's resources may grow over the run (stated in the JSON)."""

    fds: int = 64  # more open descriptors than at the first quiet point
    threads: int = 16
    rss_bytes: int = 256 << 20
    # The first quiet point is on Valkey. The S3 tier's thread pools start a
    # thread per request that finds none idle, up to their caps, and its
    # connection pool keeps up to its cap open: an S3 segment may add them all
    # without leaking anything, so they are allowed on top (0: no S3 segment).
    s3_threads: int = 0
    s3_connections: int = 0

    def allowed(self, key: str, shared: str) -> int:
        """Growth over the baseline allowed for ``key`` while on ``shared``."""
        extra = {"threads": self.s3_threads, "fds": self.s3_connections}.get(key, 0)
        return getattr(self, key) + (extra if shared == "s3" else 0)


def requests_check(outcomes: list[Outcome], expected: int) -> list[str]:
    """Every request completed with a 200 (a request that hit vLLM's own restart
    window was retried and counts by its final attempt)."""
    problems = []
    if len(outcomes) != expected:
        problems.append(f"{len(outcomes)} requests completed of {expected}")
    for o in outcomes:
        if o.status != 200:
            problems.append(f"request {o.index}: status {o.status} {o.error[:200]}")
    return problems


def outputs_check(outcomes: list[Outcome], references: list[list[int]]) -> list[str]:
    """Each output token-equal to the same prompt's output from vLLM without the connector."""
    return [
        f"request {o.index} (prompt {o.prompt}): {list(o.tokens)} != {references[o.prompt]}"
        for o in outcomes
        if o.status == 200 and list(o.tokens) != references[o.prompt]
    ]


def leases_check(status: dict) -> list[str]:
    """No lease held once the clients are idle or gone, and no slot still
    quarantined for an expired write lease (its client gone, it is freed)."""
    n = status.get("leases_active")
    problems = [] if n == 0 else [f"leases_active is {n}, not 0"]
    quarantined = status.get("counters", {}).get("quarantined_bytes", 0)
    if quarantined:
        problems.append(f"{quarantined} L1 bytes still quarantined for expired write leases")
    return problems


def exits_check(exits: list[int], kills: int) -> list[str]:
    """The sidecar exited only when the schedule SIGKILLed it (``kills`` times):
    an abort, a crash or an exit of its own under a fault fails the run even
    when the supervisor's restart hid it from vLLM."""
    problems = []
    for code in exits:
        if code != -signal.SIGKILL:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
            problems.append(f"the sidecar exited by itself ({how})")
    killed = sum(code == -signal.SIGKILL for code in exits)
    if killed > kills:
        problems.append(f"the sidecar was SIGKILLed {killed} times; the schedule did it {kills}")
    return problems


def hostile_check(reports: list[dict], rss_bound: int) -> list[str]:
    """What the hostile clients (bench/soakhostile.py) got: a lease hog is never
    granted the whole arena, and unread replies never grow the sidecar's
    resident memory by more than ``rss_bound``."""
    problems = []
    for r in reports:
        if r["kind"] == "lease_hog" and r.get("asked") and r["asked"][0]["granted"]:
            problems.append(f"lease_hog: granted a write lease of the whole arena: {r['asked']}")
        if r["kind"] == "unread_reader" and "rss_held" in r:
            grew = r["rss_held"] - r["rss_before"]
            if grew > rss_bound:
                problems.append(
                    f"unread_reader: the sidecar's RSS grew {grew >> 20} MiB with "
                    f"{r['sent']} replies unread (bound {rss_bound >> 20} MiB)"
                )
    return problems


def clients_check(status: dict, live_client_pids: set[int]) -> list[str]:
    """Every session the sidecar still holds belongs to a live client process."""
    stale = [c for c in status.get("clients", []) if c.get("pid") not in live_client_pids]
    return [f"session of a gone client still open: {c}" for c in stale]


def segments_check(shm_dir: Path, live_arenas: set[str]) -> list[str]:
    """Exactly the live sidecars' arenas are in /dev/shm, no other kvstrata segment."""
    found = {p.name for p in shm_dir.glob("kvstrata-*")}
    problems = [f"segment left behind: {name}" for name in sorted(found - live_arenas)]
    problems += [f"live arena missing: {name}" for name in sorted(live_arenas - found)]
    return problems


def mappers_check(proc_root: Path, arena: str, allowed_pids: set[int]) -> list[str]:
    """No process but the sidecar and its live clients maps the arena (an
    ipc handle a gone client still holds is a mapping that outlives it)."""
    problems = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            maps = (entry / "maps").read_text()
        except OSError:
            continue
        if f"/{arena}" in maps and int(entry.name) not in allowed_pids:
            problems.append(f"pid {entry.name} still maps {arena}")
    return problems


def writeback_check(metrics_text: str) -> list[str]:
    """Write-behind drained: every tier's write queue empty and nothing pinned for it."""
    problems = []
    for line in metrics_text.splitlines():
        if line.startswith(("kvstrata_write_queue_depth", "kvstrata_writeback_pinned_bytes")):
            name, _, value = line.rpartition(" ")
            if float(value) != 0:
                problems.append(f"write-behind not drained: {name} = {value}")
    return problems


def resources(pid: int) -> dict[str, int]:
    """Open descriptors, threads and resident bytes of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
    }


def resources_check(
    now: dict[str, int], baseline: dict[str, int], bounds: Bounds, shared: str = "valkey"
) -> list[str]:
    """Descriptors, threads and RSS within ``bounds`` of the first quiet point's,
    on the shared tier ``shared``."""
    return [
        f"sidecar {key} {now[key]} > {baseline[key]} + {bounds.allowed(key, shared)}"
        for key in ("fds", "threads", "rss_bytes")
        if now[key] > baseline[key] + bounds.allowed(key, shared)
    ]


def events_check(streams: list[list[int]]) -> list[str]:
    """vLLM's KV event stream (which carries kvstrata's tier events) per server
    incarnation: sequence numbers from the first one seen, one by one, no
    duplicate and no gap (vLLM numbers every batch it publishes)."""
    problems = []
    for n, seqs in enumerate(streams):
        seen: set[int] = set()
        for prev, seq in itertools.pairwise(seqs):
            if seq in seen or seq == prev:
                problems.append(f"server {n}: event batch {seq} delivered twice")
            elif seq != prev + 1:
                problems.append(f"server {n}: events {prev + 1}..{seq - 1} missing, unreported")
            seen.add(prev)
    return problems
