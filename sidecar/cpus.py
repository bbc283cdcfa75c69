"""The CPUs the sidecar runs on (``cpus`` in the config).

Why: on a CPU node vLLM binds its OpenMP compute threads to chosen cores
(vLLM-CPU's ``VLLM_CPU_OMP_THREADS_BIND``) and leaves the rest, its
reserved cores, to its scheduler and API server. A sidecar left to the
kernel's scheduler lands its promotion, write-behind and shared-tier threads
on the compute cores too, and each slice it takes there stalls every
request in vLLM's batch: on the 2-core benchmark VM the model's decode step
was 9% slower while promotions from L2 ran (``kvstrata bench serve``,
docs/benchmarks.md). Pinned to the reserved cores, the sidecar's work
shares them with vLLM's own non-compute processes instead.

The list has the Linux CPU-list syntax (``cpuset(7)``, what ``taskset -c``
takes): ``"1"``, ``"2-3,6"``. Every thread of the process is pinned, the
ones already running included, and threads started later inherit the
mask from the thread that starts them.
"""

from __future__ import annotations

import os
import re
from itertools import groupby

__all__ = ["format_cpu_list", "parse_cpu_list", "pin_process"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a CPU list (``"0-2,5"``); ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(
                f"{part.strip()!r} in CPU list {text!r} is neither a CPU number nor a range "
                "like 2-3"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"range {part.strip()!r} in CPU list {text!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest CPU list of ``cpus`` (``{0, 1, 2, 5}`` -> ``"0-2,5"``)."""
    parts = []
    # In a run of consecutive CPUs, CPU minus its position in the sorted list is constant.
    for _, run in groupby(enumerate(sorted(cpus)), key=lambda pair: pair[1] - pair[0]):
        first, *rest = (cpu for _, cpu in run)
        parts.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(parts)


def pin_process(cpus: frozenset[int]) -> None:
    """Pin every thread of this process to ``cpus``.

    ValueError, naming them, when some of ``cpus`` are not CPUs this process
    may run on (its cgroup's cpuset and its inherited mask): the kernel
    would refuse those silently by pinning to the rest.
    """
    allowed = os.sched_getaffinity(0)
    outside = cpus - allowed
    if outside:
        raise ValueError(
            f"cpus: CPU(s) {format_cpu_list(outside)} are not among those this process may run "
            f"on ({format_cpu_list(allowed)})"
        )
    # sched_setaffinity on a pid sets one thread's mask; a thread's id is
    # accepted there too, so each task of /proc/self/task is set in turn.
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
