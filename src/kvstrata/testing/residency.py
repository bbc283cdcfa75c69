"""How much of a mapping this process's page table maps now: what tests of
the arena's populating (kvstrata.sidecar.prefault) read back."""

from __future__ import annotations

from pathlib import Path

__all__ = ["resident_bytes"]


def resident_bytes(address: int) -> int:
    """Bytes of the mapping starting at ``address`` that this process's page
    table maps now (``Rss`` in /proc/self/smaps, proc(5))."""
    start = f"{address:x}-"
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")
