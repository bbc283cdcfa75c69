"""Whose mapping of the sidecar's arena is populated, and when
(``SidecarClient(populate_arena=...)``, kvstrata.sidecar.prefault).

A CPU worker's mappings are populated at registration, before vLLM serves,
in the registering thread: populated on a background thread, that work ran
on the core vLLM computes on during a fresh server's first requests. A
scheduler never copies through the arena, so its mapping stays unpopulated.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstrata.connector.client_arena import Populate
from kvstrata.connector.scheduler import KVStrataScheduler
from kvstrata.testing.residency import resident_bytes

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="reads page residency from Linux /proc"
)


def _mapping(client: Any) -> Any:
    arena = client._arena  # the client's own mapping (kvstrata.connector.client_arena.MappedArena)
    assert arena is not None, "the client has not mapped the arena"
    return arena.arena


def test_now_populates_before_the_call_returns_off_never(sidecar: Any, kit: Any) -> None:
    now = sidecar.client(populate_arena="now")
    off = sidecar.client(populate_arena="off")
    try:
        assert now.ping() and off.ping()
        mapped = _mapping(now)
        assert mapped.prefaulter is None  # no thread: done in the calling one
        assert resident_bytes(mapped.address()) == mapped.size
        assert _mapping(off).prefaulter is None
        assert resident_bytes(_mapping(off).address()) == 0
    finally:
        now.close()
        off.close()


def test_background_populates_on_a_thread(sidecar: Any, kit: Any) -> None:
    client = sidecar.client(populate_arena="background")
    try:
        assert client.ping()
        mapped = _mapping(client)
        assert mapped.prefaulter is not None
        assert mapped.prefaulter.done.wait(60)
        assert resident_bytes(mapped.address()) == mapped.size
    finally:
        client.close()


def test_a_connect_that_asks_for_now_populates_its_own_mapping_only(sidecar: Any, kit: Any) -> None:
    """The worker's way to populate at registration: ``connect(populate=NOW)``
    fills the mapping that call makes, and the client's own setting stays as
    made (it used to be swapped to "now" around a ping and back)."""
    client = sidecar.client(populate_arena="background")
    try:
        assert client.connect(populate=Populate.NOW)
        mapped = _mapping(client)
        assert mapped.prefaulter is None  # filled in the calling thread, not a background one
        assert resident_bytes(mapped.address()) == mapped.size
        assert client.populate_arena is Populate.BACKGROUND
    finally:
        client.close()


def test_an_unknown_populate_mode_is_refused_naming_it(sidecar: Any) -> None:
    with pytest.raises(ValueError, match="populate_arena: 'eager'"):
        sidecar.client(populate_arena="eager")


def test_a_cpu_worker_populates_its_mappings_at_registration(sidecar: Any, kit: Any) -> None:
    worker = kit.host_worker(sidecar, model="populate-test")
    try:
        step = _mapping(worker.client)  # connected and populated by register_kv_caches
        assert step.prefaulter is None
        assert resident_bytes(step.address()) == step.size
        loader = worker._background.client  # its own session, set up on its own thread
        kit.wait_until(lambda: loader.available(), 10, "the loader's session")
        kit.wait_until(
            lambda: resident_bytes(_mapping(loader).address()) == _mapping(loader).size,
            10,
            "the loader's mapping populated",
        )
        assert _mapping(loader).prefaulter is None
    finally:
        worker.close()


def test_the_scheduler_leaves_its_mapping_unpopulated(sidecar: Any, kit: Any) -> None:
    scheduler = KVStrataScheduler(kit.worker_settings(sidecar, model="populate-sched"))
    try:
        assert scheduler.client.ping()
        mapped = _mapping(scheduler.client)
        assert mapped.prefaulter is None
        assert resident_bytes(mapped.address()) == 0
    finally:
        scheduler.close()
