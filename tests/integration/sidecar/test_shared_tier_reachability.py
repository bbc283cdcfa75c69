"""A shared tier that cannot be reached at start is said at once, and recovers.

The sidecar keeps serving (``/readyz`` 200: the cache is never the source of
truth), but a warning is logged, ``kvstrata_tier_degraded{tier}`` is 1 and
``/status`` says why; once the server answers the tier is healthy again
without a request having to reach it first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvstrata.testing.servers import RedisServer, free_port


def degraded(sidecar: Any, tier: str) -> float | None:
    match = re.search(
        rf'^kvstrata_tier_degraded\{{tier="{tier}"\}} (\S+)$', sidecar.get("/metrics"), re.M
    )
    return float(match.group(1)) if match else None


def test_an_unreachable_valkey_at_start_is_a_warning_a_degraded_tier_and_a_reason(
    sidecar_factory: Any, kit: Any, valkey_binary: None, tmp_path: Path
):
    port = free_port()  # nothing listens there yet
    # breaker_reset_seconds: the re-probe interval after the first failure
    shared = kit.shared_valkey(f"redis://127.0.0.1:{port}/0", breaker_reset_seconds=0.2)
    sidecar = sidecar_factory("sc", {"shared": shared}).start()
    warning = kit.wait_until(
        lambda: re.search(
            r"WARNING.*shared tier valkey cannot be reached at start.*", sidecar.log()
        ),
        15,
        "the start-up warning about the shared tier",
    )
    assert f"{port}" in warning.group(0) or "onnect" in warning.group(0)
    assert degraded(sidecar, "valkey") == 1
    assert sidecar.get("/readyz").strip() == "ready"
    reason = sidecar.status()["tiers"]["valkey"]["degraded_reason"]
    assert reason.startswith("unreachable: ")

    with RedisServer(tmp_path / "valkey", port=port):
        kit.wait_until(lambda: degraded(sidecar, "valkey") == 0, 30, "the tier answering again")
        assert sidecar.status()["tiers"]["valkey"]["degraded_reason"] == ""
        assert "shared tier valkey answers now" in sidecar.log()
        sidecar.stop()


def test_a_reachable_valkey_at_start_is_not_degraded(
    sidecar_factory: Any, kit: Any, tmp_path: Path
):
    with RedisServer(tmp_path / "valkey") as valkey:
        shared = {"backend": "valkey", "valkey": {"url": valkey.url}}
        sidecar = sidecar_factory("sc", {"shared": shared}).start()
        kit.wait_until(lambda: "shared tier valkey answers" in sidecar.log(), 15, "the probe")
        assert degraded(sidecar, "valkey") == 0
        assert "WARNING" not in sidecar.log()
        sidecar.stop()
