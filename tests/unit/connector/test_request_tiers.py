"""kv_transfer_params: both spellings of a tier choice read the same, and
anything else is refused naming the field -- by the connector's parser and,
through vLLM's own admission check, as the error vLLM answers with."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.connector.request_tiers import (
    EVERY_TIER,
    KVTransferParamsError,
    RequestTiers,
    parse_request_tiers,
)


def test_no_params_means_every_tier():
    assert parse_request_tiers(None) == EVERY_TIER
    assert parse_request_tiers({}) == EVERY_TIER


def test_own_spelling():
    got = parse_request_tiers({"kvstrata": {"load_tiers": ["l1", "l2"], "store_tiers": ["l1"]}})
    assert got == RequestTiers(load=frozenset({"l1", "l2"}), store=frozenset({"l1"}))


def test_vllms_matchers_map_onto_the_same_tiers():
    local_memory = [{"medium": "cpu", "locality": "local"}]
    assert parse_request_tiers({"kv_load_tiers": local_memory}).load == {"l1"}
    assert parse_request_tiers({"kv_load_tiers": [{"medium": "STORAGE"}]}).load == {"l2", "shared"}
    assert parse_request_tiers({"kv_load_tiers": [{"locality": "remote"}]}).load == {"shared"}
    assert parse_request_tiers({"kv_load_tiers": [{}]}).load == {"l1", "l2", "shared"}
    assert parse_request_tiers({"kv_store_tiers": [{"locality": "local"}]}).store == {"l1", "l2"}


def test_an_empty_list_means_none_and_store_false_stores_nothing():
    assert not parse_request_tiers({"kv_load_tiers": []}).loads
    nothing = parse_request_tiers({"kvstrata": {"store": False}})
    assert not nothing.stores and nothing.loads


def test_store_tiers_below_l1_still_land_in_l1_first():
    assert parse_request_tiers({"kvstrata": {"store_tiers": ["l2"]}}).store == {"l1", "l2"}


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"kvstrata": {"load_tiers": ["l1", "l3"]}}, "kv_transfer_params.kvstrata.load_tiers[1]"),
        ({"kvstrata": {"load_tier": ["l1"]}}, "unknown key 'load_tier'"),
        ({"kvstrata": {"store": "no"}}, "kv_transfer_params.kvstrata.store"),
        ({"kvstrata": {"store": False, "store_tiers": ["l1"]}}, "leave the store tiers out"),
        ({"kvstrata": "l1"}, "kv_transfer_params.kvstrata: expected an object"),
        ({"kv_load_tiers": [{"medium": "gpu"}]}, "kv_transfer_params.kv_load_tiers[0].medium"),
        ({"kv_load_tiers": [{"tier": "cpu"}]}, "unknown key 'tier'"),
        ({"kv_load_tiers": "cpu"}, "kv_transfer_params.kv_load_tiers: expected a list"),
        ({"kv_load_tiers": [], "kvstrata": {"load_tiers": []}}, "not both"),
        ({"do_remote_prefill": True}, "unknown key 'do_remote_prefill'"),
    ],
    ids=repr,
)
def test_anything_else_is_refused_naming_the_field(params: Any, named: str):
    with pytest.raises(KVTransferParamsError) as caught:
        parse_request_tiers(params)
    assert named in str(caught.value)


def test_vllms_admission_check_turns_a_bad_value_into_a_validation_error_naming_the_parameter():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from kvstrata.connector.params_check import KVStrataParamsCheck

    good = {"kv_transfer_params": {"kvstrata": {"store_tiers": ["l1"]}}}
    KVStrataParamsCheck.validate_params(SamplingParams(extra_args=good))
    KVStrataParamsCheck.validate_params(SamplingParams())
    bad = {"kv_transfer_params": {"kvstrata": {"load_tiers": ["disk"]}}}
    with pytest.raises(VLLMValidationError) as caught:
        KVStrataParamsCheck.validate_params(SamplingParams(extra_args=bad))
    assert caught.value.parameter == "kv_transfer_params"
    assert "unknown tier 'disk'" in str(caught.value)
