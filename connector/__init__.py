"""The vLLM side of kvstrata: the KV connector and its sidecar client.

``kvstrata.connector.KVStrataConnector`` is what vLLM's
``kv_transfer_config.kv_connector_module_path`` names. It is exported
lazily: importing this package (for example to use
:class:`kvstrata.connector.client.SidecarClient` in a test or a tool) must
not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.connector.connector import KVStrataConnector

__all__ = ["KVStrataConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStrataConnector":
        from kvstrata.connector.connector import KVStrataConnector

        return KVStrataConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
