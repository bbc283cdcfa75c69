"""Optional lossless codecs for objects stored below L1.

KV tensors in bf16/fp16 compress modestly (the exponent bytes are
repetitive); the codec is off by default and measured by ``kvstrata bench
remote``. Codec ids are part of the object format: never renumber them.
"""

from __future__ import annotations

from typing import Literal

import lz4.frame
import zstandard

CodecName = Literal["none", "zstd", "lz4"]

CODEC_IDS: dict[str, int] = {"none": 0, "zstd": 1, "lz4": 2}
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}

_ZSTD_LEVEL = 1  # fast: the shared tier is bandwidth-bound, not space-bound


class CodecError(ValueError):
    """Compressed payload could not be decoded."""


def compress(codec: str, data: bytes | memoryview) -> bytes | memoryview:
    if codec == "none":
        return data
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    if codec == "lz4":
        return lz4.frame.compress(data, compression_level=0)
    raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(CODEC_IDS)}")


def decompress(codec: str, data: bytes | memoryview, raw_length: int) -> bytes | memoryview:
    try:
        if codec == "none":
            return data
        if codec == "zstd":
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
        if codec == "lz4":
            return lz4.frame.decompress(data)
    except (zstandard.ZstdError, RuntimeError) as exc:
        raise CodecError(f"{codec} payload is corrupt: {exc}") from None
    raise CodecError(f"unknown codec {codec!r}")
