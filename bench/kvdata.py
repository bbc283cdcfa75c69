"""Synthetic KV-cache-like bytes for the codec and transfer benchmarks.

Real KV caches hold bf16 activations: roughly normal values whose exponent
bytes repeat a lot and whose mantissa bytes look random. Random normal
values rounded to bf16 reproduce that, which is what a codec's ratio on
real KV depends on (random bytes would say "incompressible", zeros would
flatter it).
"""

from __future__ import annotations

import numpy as np


def bf16_kv_like(nbytes: int, seed: int = 0, scale: float = 1.0) -> bytes:
    """``nbytes`` (rounded down to even) of bf16 values drawn from N(0, scale)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(nbytes // 2, dtype=np.float32) * np.float32(scale)
    bits = values.view(np.uint32)
    # Round to nearest even on the 16 bits that bf16 drops.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return rounded.astype(np.uint16).tobytes()
