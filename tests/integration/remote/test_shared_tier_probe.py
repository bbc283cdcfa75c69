"""``Tier.probe`` on every shared backend: a server that answers is not
degraded; one that does not is degraded at once, with the reason, and a
later successful probe clears both."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.testing.servers import free_port


def test_a_shared_tier_whose_server_answers_probes_healthy(shared_backend: Any) -> None:
    tier, _ = shared_backend.make_tier()
    assert tier.probe() is None
    stats = tier.stats()
    assert not stats.degraded and stats.degraded_reason == ""


def nobody_at(kind: str, port: int, credentials: dict[str, str]) -> SharedConfig:
    if kind == "valkey":
        return SharedConfig(backend="valkey", valkey={"url": f"redis://127.0.0.1:{port}/0"})
    return SharedConfig(
        backend="s3",
        s3={
            "endpoint_url": f"http://127.0.0.1:{port}",
            "bucket": "kvstrata-test",
            "timeout_seconds": 2.0,
            **credentials,
        },
    )


@pytest.mark.parametrize("kind", ["valkey", "s3"])
def test_a_shared_tier_nobody_answers_for_is_degraded_by_one_probe_with_the_reason(
    kind: str, s3_credentials: dict[str, str]
) -> None:
    tier = build_shared_tier(nobody_at(kind, free_port(), s3_credentials))
    assert tier is not None
    try:
        assert not tier.stats().degraded  # nothing asked yet
        why = tier.probe()
        assert why
        stats = tier.stats()
        assert stats.degraded and stats.breaker_state == "open"
        assert stats.degraded_reason == f"unreachable: {why}"
    finally:
        tier.close()


def test_a_probe_that_succeeds_clears_the_degraded_state(shared_backend: Any) -> None:
    tier, _ = shared_backend.make_tier()
    tier._probe_failure = "unreachable: earlier"  # as a failed probe leaves it
    tier._breaker.trip()
    assert tier.stats().degraded_reason == "unreachable: earlier"
    assert tier.probe() is None
    stats = tier.stats()
    assert not stats.degraded and stats.degraded_reason == ""
