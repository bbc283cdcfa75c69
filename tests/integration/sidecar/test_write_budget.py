"""The per-session write budget refuses nothing a well-behaved worker asks:
the worker sizes its store calls by the budget the sidecar names at HELLO,
its very first save included (before it, no session was set up)."""

from __future__ import annotations

import re
from typing import Any

from kvstrata.connector.metadata import KVStrataMetadata

# The worker case's chunk: 3 layers x 2 blocks x (K and V) x 16 x 128 bf16 values.
CHUNK_BYTES = 3 * 2 * 2 * 16 * 128 * 2
L1_BYTES = 16 << 20  # the test sidecar's arena


def write_budget_errors(sidecar: Any) -> float:
    text = sidecar.get("/metrics")
    match = re.search(r'^kvstrata_errors_total\{kind="write_budget"\} (\S+)$', text, re.M)
    return 0.0 if match is None else float(match.group(1))


def test_a_fresh_workers_first_step_larger_than_its_budget_is_stored_whole(
    sidecar_factory: Any, kit: Any
) -> None:
    # A budget of two chunks; the step saves six.
    fraction = 2 * CHUNK_BYTES / L1_BYTES
    sidecar = sidecar_factory(overrides={"server": {"session_write_fraction": fraction}}).start()
    w = kit.host_worker(sidecar, model="budget-test")
    try:
        assert w.layout is not None and w.layout.chunk_nbytes == CHUNK_BYTES
        reqs = kit.chunk_requests("first-step", 3, 2)
        w.save(KVStrataMetadata(saves=reqs))
        assert write_budget_errors(sidecar) == 0
        assert w.counters.saved_chunks == 6, w.client.errors
        assert w.counters.save_skipped_chunks == 0
        # And a steady state of such steps stays within it too.
        for step in range(3):
            w.save(KVStrataMetadata(saves=kit.chunk_requests(f"step-{step}", 3, 2)))
        assert write_budget_errors(sidecar) == 0
        assert w.counters.saved_chunks == 24
    finally:
        w.close()
