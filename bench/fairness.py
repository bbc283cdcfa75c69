"""Equal resources for every system a benchmark sets side by side.

Why: a ratio between vLLM alone and vLLM with kvstrata means something
only when both ran on the same CPUs with the same threads. vLLM-CPU does
not guarantee that by itself: with a ``kv_transfer_config`` it reserves
more cores for its scheduler (``vllm/utils/ompmultiprocessing.py``,
``reserve_cpu_num``), and its serving path lowers torch's thread count
unless ``OMP_NUM_THREADS`` is set outside it
(``vllm/utils/torch_utils.py``, ``set_torch_threads_for_runtime``). So each
benchmark sets the binding explicitly, reads back what every engine really
got, runs the systems interleaved (A B A B ...) and gives no ratio when the
bindings differ. ``bench serve`` reads its servers' bindings from their
logs; the in-process benchmarks use :func:`in_process_binding`.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

RUNS = 3  # each system at least this often, interleaved, for a median and a spread
REFUSED = "the systems ran with different CPU bindings"


def pin_in_process_threads() -> None:
    """Give every in-process engine of this run the same torch threads.

    vLLM reduces torch's threads to one "for serving" unless
    ``OMP_NUM_THREADS`` comes from outside, and vLLM-CPU's worker then
    blocks ``torch.set_num_threads`` (``vllm/v1/worker/cpu_worker.py``), so
    the first engine of a process decides for every later one. Setting it
    here, to the CPUs this process may run on, makes the count a fact of the
    run instead of an accident of the order. Call before importing torch.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))


def prepare_in_process_engines() -> None:
    """Before importing vLLM: the same torch threads for every engine of this
    process, and the environment vLLM-CPU needs."""
    from kvstrata.testing.localstack import set_vllm_env

    pin_in_process_threads()
    set_vllm_env()


def in_process_binding() -> dict[str, Any]:
    """The CPU binding an engine running in this process has right now."""
    import torch

    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def bindings_equal(bindings: Iterable[Mapping[str, Any] | None]) -> bool:
    """True when every binding was read and all are the same."""
    seen = list(bindings)
    if not seen or any(b is None for b in seen):
        return False
    return len({json.dumps(b, sort_keys=True) for b in seen}) == 1


def interleaved(systems: Sequence[str], runs: int) -> list[tuple[int, str]]:
    """(run, system) in the order A B A B ...: drift on the machine hits both alike."""
    return [(run, system) for run in range(runs) for system in systems]


def median_spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
