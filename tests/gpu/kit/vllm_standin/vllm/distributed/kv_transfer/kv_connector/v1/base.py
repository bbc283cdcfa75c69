"""Stand-in (test double) for ``vllm.distributed.kv_transfer.kv_connector.v1.base``:
vLLM 0.32 declares ``KVConnectorMetadata`` an empty abstract class there, which
the connector's metadata subclasses (see ``vllm_standin/vllm/__init__.py``)."""

import abc


class KVConnectorMetadata(abc.ABC):  # noqa: B024 - empty in vLLM too
    """Empty, as vLLM's: the connector's own metadata carries every field."""
