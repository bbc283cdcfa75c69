"""KV cache tensors built exactly like vLLM's, on any device, for tests.

Each builder returns a :class:`KVLayoutCase`: per-layer tensors with the
shapes *and strides* vLLM hands a connector, filled with random bytes. The
vLLM >= 0.32 builders follow ``vllm/v1/kv_cache_interface.py``
(``compute_layout_strides`` / ``create_kv_cache_views``): one int8 buffer,
a 5-D ``[L, B, H, N, C-bytes]`` view strided by the layout's permutation,
one ``[B, H, N, C]`` view per layer, then ``.view(dtype)``. The legacy
builders follow the per-layer shapes of earlier vLLM releases
(FlashAttention ``[2, B, N, H, D]``, FlashInfer ``[B, 2, N, H, D]``, each
also with heads before tokens; MLA ``[B, N, latent]``; vLLM-CPU
``[B, H, N, 2D]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# vLLM's KVCacheLayout stride permutations over logical [L, B, H, N, C].
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def layout_to_check(kv_cache_layout: str | None) -> str | None:
    """The layout name to hand ``detect_layout``: ``kv_cache_layout`` where vLLM is
    importable (its ``KVCacheLayout`` says what the strides must be), else None
    (the plan is read from the strides alone, as for tests). The GPU machines the
    kit runs on have no vLLM; the byte copies checked there are the same either way."""
    if kv_cache_layout is None:
        return None
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401
    except ImportError:
        return None
    return kv_cache_layout


@dataclass
class KVLayoutCase:
    name: str
    layers: dict[str, torch.Tensor]  # layer name -> KV tensor, in model order
    block_dim: int
    kv_cache_layout: str | None  # vLLM's layout name (None for legacy shapes)
    num_blocks: int


def _randomize(buf: torch.Tensor, gen: torch.Generator) -> None:
    flat = buf.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def _names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def vllm_layers(
    layout: str,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    heads: int = 2,
    tokens: int = 16,
    content: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    buffer: torch.Tensor | None = None,
) -> KVLayoutCase:
    """vLLM >= 0.32: per-layer ``[B, H, N, content]`` views of one buffer
    (``buffer``: an int8 tensor to build them in, at least that large)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (num_layers, num_blocks, heads, tokens, content * itemsize)
    strides = [0] * 5
    step = 1
    for dim in reversed(VLLM_LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    raw = buffer if buffer is not None else torch.empty(0, dtype=torch.int8, device=device)
    if raw.numel() < math.prod(shape):
        raw = torch.empty(math.prod(shape), dtype=torch.int8, device=device)
    raw = raw[: math.prod(shape)]
    _randomize(raw, torch.Generator().manual_seed(seed))
    layers = {}
    for name, layer in zip(_names(num_layers), range(num_layers), strict=True):
        view = torch.as_strided(raw, shape[1:], strides[1:], layer * strides[0])
        layers[name] = view.view(dtype)
    return KVLayoutCase(f"vllm-{layout}-{dtype}", layers, 0, layout, num_blocks)


def _legacy(
    name: str,
    logical: tuple[int, ...],
    physical_order: tuple[int, ...],
    block_dim: int,
    num_layers: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> KVLayoutCase:
    gen = torch.Generator().manual_seed(seed)
    physical = tuple(logical[d] for d in physical_order)
    inverse = [physical_order.index(d) for d in range(len(logical))]
    layers = {}
    for layer_name in _names(num_layers):
        t = torch.empty(physical, dtype=dtype, device=device)
        _randomize(t, gen)
        layers[layer_name] = t.permute(*inverse)
    return KVLayoutCase(f"{name}-{dtype}", layers, block_dim, None, logical[block_dim])


def flash_attn_layers(
    hnd: bool = False,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 16,
    heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> KVLayoutCase:
    """FlashAttention ``[2, B, N, H, D]``; ``hnd``: memory order ``[2, B, H, N, D]``."""
    order = (0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4)
    logical = (2, num_blocks, block_size, heads, head_dim)
    name = "flash-attn-" + ("hnd" if hnd else "nhd")
    return _legacy(name, logical, order, 1, num_layers, dtype, device, seed)


def flashinfer_layers(
    hnd: bool = False,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 16,
    heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> KVLayoutCase:
    """FlashInfer ``[B, 2, N, H, D]``; ``hnd``: memory order ``[B, 2, H, N, D]``."""
    order = (0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4)
    logical = (num_blocks, 2, block_size, heads, head_dim)
    name = "flashinfer-" + ("hnd" if hnd else "nhd")
    return _legacy(name, logical, order, 0, num_layers, dtype, device, seed)


def mla_layers(
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 16,
    latent: int = 576,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> KVLayoutCase:
    """MLA ``[B, N, kv_lora_rank + rope_dim]`` (DeepSeek: 512 + 64)."""
    logical = (num_blocks, block_size, latent)
    return _legacy("mla", logical, (0, 1, 2), 0, num_layers, dtype, device, seed)


def cpu_legacy_layers(
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 32,
    heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> KVLayoutCase:
    """vLLM-CPU before 0.32: ``[B, H, N, 2 * D]``."""
    logical = (num_blocks, heads, block_size, 2 * head_dim)
    return _legacy("vllm-cpu-legacy", logical, (0, 1, 2, 3), 0, num_layers, dtype, device, seed)


def every_case(dtype: torch.dtype, device: str = "cpu") -> list[KVLayoutCase]:
    """One case of every layout in ``dtype``."""
    cases = [vllm_layers(name, dtype=dtype, device=device) for name in VLLM_LAYOUTS]
    cases += [
        flash_attn_layers(False, dtype=dtype, device=device),
        flash_attn_layers(True, dtype=dtype, device=device),
        flashinfer_layers(False, dtype=dtype, device=device),
        flashinfer_layers(True, dtype=dtype, device=device),
        mla_layers(dtype=dtype, device=device),
        cpu_legacy_layers(dtype=dtype, device=device),
    ]
    return cases
