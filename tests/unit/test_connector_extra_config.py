"""The connector's extra config: a key it does not read is refused, naming the
key and the keys it does read (a typo would otherwise be silently ignored)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.connector.settings import EXTRA_CONFIG_KEYS, settings_from_config


def vllm_config(extra: dict[str, Any]) -> Any:
    """Only the part of vLLM's config read before the keys are checked."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_a_misspelt_key_is_refused_naming_it_and_every_known_key() -> None:
    extra = {"endpoint": "ipc:///tmp/x.sock", "call_timout_seconds": 2.0}
    with pytest.raises(ValueError) as refused:
        settings_from_config(vllm_config(extra), SimpleNamespace())
    message = str(refused.value)
    assert "'call_timout_seconds'" in message
    assert "'endpoint'" not in message.partition(";")[0]
    for name in ("endpoint", "call_timeout_seconds", "load_async", "curve_client_certificate"):
        assert name in message.partition(";")[2]


def test_every_unknown_key_is_named_at_once() -> None:
    with pytest.raises(ValueError, match="'chunksize', 'transfermode'"):
        settings_from_config(vllm_config({"transfermode": "ipc", "chunksize": 64}), None)


def test_the_known_keys_are_the_keys_the_settings_read() -> None:
    """Each documented key is accepted (no key table entry the settings refuse)."""
    names = [key.name for key in EXTRA_CONFIG_KEYS]
    assert len(names) == len(set(names))
    assert {"endpoint", "chunk_size", "transfer_mode", "kv_cache_layout"} <= set(names)
