"""The soak's silent lease hog against a real sidecar: it gets only its share
of L1, the leases check sees its quarantined slot while it lives, and once it
vanishes (its session timed out) nothing is left for the check to find.
Ordered by the sidecar's own counters, not the clock."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.bench import soakchecks as checks
from kvstrata.bench.soakhostile import LeaseHog
from kvstrata.testing.poll import wait_until
from kvstrata.testing.sidecarproc import SidecarProcess

L1_BYTES = 4 << 20


class _Sidecar(SidecarProcess):
    error = AssertionError


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    sc = _Sidecar(
        tmp_path / "sc",
        chunk_size=64,
        l1_size=str(L1_BYTES),
        l2_size="4Mi",
        overrides={"server": {"lease_seconds": 0.5, "client_timeout_seconds": 2.0}},
    )
    sc.start()
    try:
        yield sc
    finally:
        sc.stop()


def quarantined(sidecar: SidecarProcess) -> int:
    return int(sidecar.status()["counters"].get("quarantined_bytes", 0))


def test_the_lease_hog_pins_only_its_share_and_leaves_nothing_behind(
    sidecar: SidecarProcess,
) -> None:
    hog = LeaseHog(sidecar.endpoint, sidecar.http_port).start()
    try:
        wait_until(lambda: quarantined(sidecar) > 0, 30, "the hog's lease to expire")
        assert checks.leases_check(sidecar.status())  # a quarantined slot is a held slot
        report = hog.report()
        assert report["asked"][0] == {"bytes": L1_BYTES, "granted": False}, report
        assert report["granted_bytes"] == L1_BYTES // 4 == quarantined(sidecar)
        assert checks.hostile_check([{"kind": "lease_hog", **report}], 0) == []
        assert sidecar.status()["leases_active"] == 0
    finally:
        hog.stop()
    assert hog.error == "" and hog.report()["quarantined_seen"] is True
    # It vanished without a word: its session times out and its slot is freed.
    wait_until(lambda: checks.leases_check(sidecar.status()) == [], 30, "the slot freed")
    assert checks.clients_check(sidecar.status(), set()) == []


def test_the_exits_check_fails_an_exit_the_schedule_did_not_cause() -> None:
    kill, abort = -signal.SIGKILL, -signal.SIGABRT
    assert checks.exits_check([], kills=0) == []
    assert checks.exits_check([kill, kill], kills=2) == []
    assert checks.exits_check([kill, abort], kills=1) == [
        "the sidecar exited by itself (signal SIGABRT)"
    ]
    assert checks.exits_check([1], kills=0) == ["the sidecar exited by itself (status 1)"]
    assert checks.exits_check([kill], kills=0) == [
        "the sidecar was SIGKILLed 1 times; the schedule did it 0"
    ]


def test_the_hostile_check_fails_a_hog_given_the_arena_and_unread_replies_held_in_memory() -> None:
    hog = {"kind": "lease_hog", "asked": [{"bytes": L1_BYTES, "granted": True}]}
    reader = {"kind": "unread_reader", "sent": 2000, "rss_before": 100 << 20}
    bound = 256 << 20
    assert checks.hostile_check([{**reader, "rss_held": 300 << 20}], bound) == []
    problems = checks.hostile_check([hog, {**reader, "rss_held": 700 << 20}], bound)
    assert len(problems) == 2
    assert problems[0].startswith("lease_hog: granted a write lease of the whole arena")
    assert problems[1] == (
        "unread_reader: the sidecar's RSS grew 600 MiB with 2000 replies unread (bound 256 MiB)"
    )
