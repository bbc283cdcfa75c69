"""The bytes a chunk must hold, written with plain torch indexing, for tests of any copier.

Also the harness around it: poisoned chunk buffers (:class:`ChunkArena`),
random block ids, and one layout kvlayouts does not build (padded pages at
an unaligned address, :func:`padded_unaligned_layers`).

Why a second description of the chunk format: the copiers (torch, CUDA
kernels, their host build) all derive their byte offsets from a
:class:`~kvstrata.sidecar.transfer.plan.CopyPlan` read from strides, so a
test that asked the plan for the expected bytes would agree with any bug the
plan has. This module states each layout's page order by hand instead: for
every layout built by :mod:`kvstrata.testing.kvlayouts`, the dimensions of
one layer's block in memory order. A chunk is then, per the format in
``plan.py``:

- layer-outer (default): for each layer, for each block, that block's bytes;
- block-outer (layouts whose blocks hold every layer, ``BL..`` / ``BH..``):
  for each block, for each layer, that block's bytes;

where "a block's bytes" are the layer tensor's elements of that block,
walked in memory order (gaps between runs are not part of a chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from kvstrata.testing import kvlayouts
from kvstrata.testing.kvlayouts import KVLayoutCase

POISON = 0xA5  # what untouched bytes of chunk buffers hold
GUARD = 64  # poisoned bytes before and between chunk buffers

# Dimensions of one layer's tensor (block dimension left out) from the outermost
# to the innermost in memory. vLLM >= 0.32 per-layer views are [B, H, N, C]; the
# legacy shapes are those of kvlayouts' builders.
PAGE_ORDER: dict[str, tuple[int, ...]] = {
    "LBHNC": (1, 2, 3),
    "LBNHC": (2, 1, 3),
    "LHBNC": (1, 2, 3),
    "BLHNC": (1, 2, 3),
    "BLNHC": (2, 1, 3),
    "BHLNC": (1, 2, 3),
    "flash-attn-nhd": (0, 2, 3, 4),  # [2, B, N, H, D]
    "flash-attn-hnd": (0, 3, 2, 4),  # [2, B, N, H, D] stored as [2, B, H, N, D]
    "flashinfer-nhd": (1, 2, 3, 4),  # [B, 2, N, H, D]
    "flashinfer-hnd": (1, 3, 2, 4),  # [B, 2, N, H, D] stored as [B, 2, H, N, D]
    "mla": (1, 2),  # [B, N, latent]
    "vllm-cpu-legacy": (1, 2, 3),  # [B, H, N, 2D]
    "padded-LBNHC": (2, 1, 3),  # padded_unaligned_layers: LBNHC views
}

# Layouts whose chunks are block-outer: a block's pages of all layers are one region.
BLOCK_OUTER = frozenset({"BLHNC", "BLNHC", "BHLNC"})


def layout_key(case: KVLayoutCase) -> str:
    """The key of ``case`` in :data:`PAGE_ORDER` (vLLM's layout name, or the legacy shape's)."""
    key = case.kv_cache_layout or case.name.rsplit("-torch.", 1)[0]
    if key not in PAGE_ORDER:
        raise KeyError(f"no reference page order for layout case {case.name!r}")
    return key


def _page_view(case: KVLayoutCase, layer: torch.Tensor, block: int) -> torch.Tensor:
    """One block of ``layer`` with its dimensions permuted into memory order (a view)."""
    order = PAGE_ORDER[layout_key(case)]
    dims = [d if d < case.block_dim else d - 1 for d in order]
    return layer.select(case.block_dim, block).permute(*dims)


def page_bytes(case: KVLayoutCase, layer: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of ``layer``'s block ``block`` in memory order (1-D uint8, a copy)."""
    return _page_view(case, layer, block).contiguous().view(torch.uint8).flatten()


def write_page(case: KVLayoutCase, layer: torch.Tensor, block: int, data: torch.Tensor) -> None:
    """Store ``data`` (1-D uint8, memory order) into ``layer``'s block ``block``."""
    view = _page_view(case, layer, block)
    view.copy_(data.view(layer.dtype).view(view.shape))


def chunk_bytes(
    case: KVLayoutCase, block_ids: Sequence[int], fill: int, layers: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The bytes of one chunk of the blocks ``block_ids`` of ``case`` (or of ``layers``).

    A negative id stands for a position the copy skips: its bytes are ``fill``.
    """
    tensors = list(layers) or list(case.layers.values())
    nbytes = page_bytes(case, tensors[0], 0).numel()
    device = tensors[0].device

    def slot(layer: torch.Tensor, block: int) -> torch.Tensor:
        if block < 0:
            return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)
        return page_bytes(case, layer, block)

    if layout_key(case) in BLOCK_OUTER:
        parts = [slot(t, b) for b in block_ids for t in tensors]
    else:
        parts = [slot(t, b) for t in tensors for b in block_ids]
    return torch.cat(parts)


def scatter_reference(
    case: KVLayoutCase,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    chunk: torch.Tensor,
) -> None:
    """Store ``chunk`` (one chunk's bytes) into the blocks ``block_ids`` of ``layers``;
    negative ids are skipped."""
    nbytes = page_bytes(case, layers[0], 0).numel()
    block_outer = layout_key(case) in BLOCK_OUTER
    for p, block in enumerate(block_ids):
        if block < 0:
            continue
        for i, layer in enumerate(layers):
            slot = p * len(layers) + i if block_outer else i * len(block_ids) + p
            write_page(case, layer, block, chunk[slot * nbytes : (slot + 1) * nbytes])


def clone_layers(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``layers`` with the same strides over copies of their storages
    (layers that shared a storage share the copy), padding bytes included."""
    copies: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in layers:
        storage = t.untyped_storage()
        copy = copies.setdefault(storage.data_ptr(), storage.clone())
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        out.append(view.set_(copy, t.storage_offset(), t.shape, t.stride()))
    return out


def storage_bytes(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every byte of the distinct storages under ``layers`` (gaps and padding too)."""
    seen: dict[int, torch.Tensor] = {}
    for t in layers:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            seen[storage.data_ptr()] = flat.set_(storage)
    return list(seen.values())


def padded_unaligned_layers(
    dtype: torch.dtype, *, device: str = "cpu", seed: int = 0
) -> KVLayoutCase:
    """LBNHC per-layer views whose blocks and layers are padded (48 and 16 bytes) and
    whose buffer starts one element past a 16-byte boundary, so no access wider than
    the dtype fits every address."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layers, blocks, heads, tokens, content = 3, 12, 2, 16, 40 * itemsize
    page = heads * tokens * content
    block_stride = page + 48
    layer_stride = blocks * block_stride + 16
    strides = (block_stride, content, heads * content, 1)  # tokens outside heads
    raw = torch.empty(itemsize + layers * layer_stride, dtype=torch.int8)
    gen = torch.Generator().manual_seed(seed)
    raw.view(torch.uint8).copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    raw = raw.to(device)
    views = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            raw, (blocks, heads, tokens, content), strides, itemsize + i * layer_stride
        ).view(dtype)
        for i in range(layers)
    }
    return KVLayoutCase(f"padded-LBNHC-{dtype}", views, 0, None, blocks)


def random_block_ids(num_blocks: int, count: int, seed: int, skip: Sequence[int] = ()) -> list[int]:
    """``count`` distinct, non-consecutive random block ids; positions in ``skip`` are -1."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    ids = perm[:count]
    for pos in skip:
        ids[pos] = -1
    return ids


class ChunkArena:
    """Chunk buffers inside one poisoned byte tensor, out of order and :data:`GUARD` apart.

    ``pinned``: page-locked host memory (the GPU reaches it over PCIe, zero-copy).
    """

    def __init__(
        self, num_chunks: int, chunk_nbytes: int, *, device: str = "cpu", pinned: bool = False,
        seed: int = 0,
    ) -> None:  # fmt: skip
        self.chunk_nbytes = chunk_nbytes
        size = GUARD + num_chunks * (chunk_nbytes + GUARD)
        self.buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pinned)
        self.buf.fill_(POISON)
        slots = torch.randperm(num_chunks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.offsets = [GUARD + s * (chunk_nbytes + GUARD) for s in slots]

    @property
    def addresses(self) -> list[int]:
        """Each chunk's byte address (host or device, as the buffer is)."""
        return [self.buf.data_ptr() + off for off in self.offsets]

    def chunk(self, c: int) -> torch.Tensor:
        """Chunk ``c`` as a byte view."""
        return self.buf[self.offsets[c] : self.offsets[c] + self.chunk_nbytes]

    def expected_after_gather(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole arena once ``chunks[c]`` is in chunk ``c`` and nothing else changed."""
        expected = torch.full_like(self.buf, POISON)
        for c, data in enumerate(chunks):
            expected[self.offsets[c] : self.offsets[c] + self.chunk_nbytes] = data
        return expected


def layout_builders() -> dict[str, Callable[..., KVLayoutCase]]:
    """Every layout the kernels are tested on, by name: ``builder(dtype=..., device=...)``."""
    return {
        **{f"vllm-{name}": partial(kvlayouts.vllm_layers, name) for name in kvlayouts.VLLM_LAYOUTS},
        "flash-attn-nhd": partial(kvlayouts.flash_attn_layers, False),
        "flash-attn-hnd": partial(kvlayouts.flash_attn_layers, True),
        "flashinfer-nhd": partial(kvlayouts.flashinfer_layers, False),
        "flashinfer-hnd": partial(kvlayouts.flashinfer_layers, True),
        "mla": kvlayouts.mla_layers,
        "vllm-cpu-legacy": kvlayouts.cpu_legacy_layers,
        "padded-unaligned": padded_unaligned_layers,
    }
