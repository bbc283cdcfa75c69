"""vLLM's ``kv_transfer_config`` that selects the kvstrata connector, as a plain dict.

One builder for every place that points vLLM at a sidecar: the operator's
admission webhook renders it as the ``--kv-transfer-config`` flag, the local
stack (``kvstrata demo``, ``kvstrata bench e2e``, the end-to-end tests) turns
it into vLLM's ``KVTransferConfig``. This module imports neither vLLM nor
kopf: the operator image has no vLLM, and the connector never imports kopf.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_CLASS = "KVStrataConnector"
CONNECTOR_MODULE = "kvstrata.connector"
# A failed load (sidecar gone between lookup and load) must cost a recompute,
# never a failed request (vLLM's default is "fail"); the connector warns at
# start when the config says otherwise.
LOAD_FAILURE_POLICY = "recompute"


def kv_transfer_config(
    endpoint: str,
    *,
    load_failure_policy: str | None = LOAD_FAILURE_POLICY,
    **extra_config: Any,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` fields for the kvstrata connector on ``endpoint``.

    ``extra_config`` goes into ``kv_connector_extra_config`` after the
    endpoint (the keys the connector reads: ``chunk_size``,
    ``call_timeout_seconds`` ...). ``load_failure_policy=None`` leaves
    ``kv_load_failure_policy`` out: vLLM then applies its default (``fail``)
    and the connector warns at start. Keys keep a fixed order, so a rendered
    flag is the same text each time.
    """
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    if load_failure_policy is not None:
        config["kv_load_failure_policy"] = load_failure_policy
    config["kv_connector_extra_config"] = {"endpoint": endpoint, **extra_config}
    return config
