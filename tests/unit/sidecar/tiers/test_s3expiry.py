"""The expiry an S3 object of a tenant with a TTL carries, and how a read judges it."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.tiers.s3expiry import EXPIRES_KEY, expired, expiry_metadata, has_expiry


def test_an_object_expires_its_ttl_after_it_was_written() -> None:
    metadata = expiry_metadata(3600.0, now=1000.0)
    assert metadata == {EXPIRES_KEY: "4600.000"}
    response = {"Metadata": metadata}
    assert has_expiry(response)
    assert not expired(response, now=4599.5)
    assert expired(response, now=4600.0)


def test_no_ttl_writes_no_expiry_and_never_expires() -> None:
    assert expiry_metadata(None, now=1000.0) == {}
    assert not has_expiry({"Metadata": {}})
    assert not expired({"Metadata": {}}, now=10.0**12)
    assert not expired({}, now=10.0**12)  # a response without user metadata at all


@pytest.mark.parametrize("value", ["soon", "", "nan", "inf"])
def test_an_expiry_that_does_not_parse_is_not_served(value: str) -> None:
    assert expired({"Metadata": {EXPIRES_KEY: value}}, now=0.0)
