"""A connector worker role over stand-in KV tensors, and requests for it.

Why: the sidecar suite and the GPU suite both drive the real
:class:`~kvstrata.connector.worker.KVStrataWorker` against a real sidecar
without vLLM around it: KV tensors in vLLM's first layout case (bf16, two
blocks per chunk) on the CPU or a GPU, settings as the connector would read
them, and transfers naming distinct blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer
from kvstrata.connector.settings import ConnectorSettings
from kvstrata.connector.worker import KVStrataWorker
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import ModeSetting

if TYPE_CHECKING:
    from kvstrata.testing.sidecarproc import SidecarProcess

WORKER_BLOCK_SIZE = 8
WORKER_CHUNK = 2 * WORKER_BLOCK_SIZE


def case_settings(
    endpoint: str,
    case: Any,
    model: str,
    layout: str | None = None,
    **namespace: Any,
) -> ConnectorSettings:
    """Connector settings in host mode for the KV of ``case`` (a
    :class:`~kvstrata.testing.kvlayouts.KVLayoutCase`), two blocks per chunk;
    ``layout`` overrides the namespace layout string, ``namespace`` adds
    fields of the :class:`Namespace` (``kv_dtype``, ``tp_size`` ...)."""
    from kvstrata.connector.layout import layout_id

    # Legacy shapes carry no vLLM layout name: the case name stands in for it.
    layout = layout or layout_id("cuda", case.kv_cache_layout or case.name, None)
    return ConnectorSettings(
        endpoint=endpoint,
        call_timeout_s=2.0,
        load_timeout_s=5.0,
        chunk_size=WORKER_CHUNK,
        block_size=WORKER_BLOCK_SIZE,
        num_blocks=case.num_blocks,
        kv_cache_layout=case.kv_cache_layout,
        layout=layout,
        transfer_mode=ModeSetting.HOST,
        namespace=Namespace(
            model=model,
            layout=layout or "",
            block_size=WORKER_BLOCK_SIZE,
            chunk_size=WORKER_CHUNK,
            **namespace,
        ),
    )


def worker_settings(
    sidecar: SidecarProcess, model: str, device: str = "cpu", **settings: Any
) -> ConnectorSettings:
    """:func:`case_settings` for :func:`host_worker`'s KV (vLLM's first layout
    case, bf16, on ``device``); ``settings`` override fields."""
    return replace(case_settings(sidecar.endpoint, _worker_case(device), model), **settings)


def host_worker(
    sidecar: SidecarProcess, model: str, device: str = "cpu", **settings: Any
) -> KVStrataWorker:
    """A connector worker role in host mode over KV tensors on ``device`` (see
    :func:`worker_settings`)."""
    s = worker_settings(sidecar, model, device, **settings)
    worker = KVStrataWorker(s, None)  # type: ignore[arg-type]
    worker.register_kv_caches(_worker_case(device).layers)
    return worker


def _worker_case(device: str) -> Any:
    import torch

    from kvstrata.testing.kvlayouts import every_case

    return every_case(torch.bfloat16, device=device)[0]


def chunk_requests(test: str, n_requests: int, chunks_each: int) -> list[RequestTransfer]:
    """``n_requests`` requests of ``chunks_each`` two-block chunks each, on
    distinct blocks, with hashes unique to ``test``."""
    out = []
    block = 0
    for r in range(n_requests):
        chunks = []
        for c in range(chunks_each):
            h = hashlib.sha256(f"{test}/{r}/{c}".encode()).digest()
            chunks.append(ChunkTransfer(h, [block, block + 1]))
            block += 2
        out.append(RequestTransfer(f"req-{r}", chunks))
    return out
