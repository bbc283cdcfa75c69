"""The one ``kv_transfer_config`` builder: its fields, and that it imports no vLLM or kopf."""

from __future__ import annotations

import subprocess
import sys

from kvstrata.connector.transfer_config import kv_transfer_config


def test_the_builder_names_the_connector_its_endpoint_and_the_recompute_policy():
    assert kv_transfer_config("ipc:///s.sock", chunk_size=64, call_timeout_seconds=2.0) == {
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "endpoint": "ipc:///s.sock",
            "chunk_size": 64,
            "call_timeout_seconds": 2.0,
        },
    }


def test_without_a_policy_the_field_is_left_out():
    assert "kv_load_failure_policy" not in kv_transfer_config("e", load_failure_policy=None)


def test_importing_the_builder_imports_neither_vllm_nor_kopf():
    code = (
        "import sys, kvstrata.connector.transfer_config; "
        "assert not {'vllm', 'kopf'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
