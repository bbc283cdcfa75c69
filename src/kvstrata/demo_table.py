"""What ``kvstrata demo`` measured, and the lines it prints about it.

Why apart from :mod:`kvstrata.demo`: the demo's figures are worth a test of
their own (medians of repeats, the comparison with vLLM's own prefix cache,
what is said when a case had no hit), and those tests must not start vLLM.

A *case* is one way a prompt's prefix is served; each is measured once per
repeat, every repeat on a document of its own:

* ``cold``: nothing holds the document; vLLM computes it (and kvstrata saves it)
* ``vllm``: the same document again, served by vLLM's own prefix cache (on, as
  in production): what a user compares kvstrata with
* ``l1`` / ``l2`` / ``shared``: vLLM's prefix cache emptied first (as after an
  eviction, a restart or on a new replica), so the prefix comes from kvstrata's
  memory, its disk after a sidecar restart, or the shared tier
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

CASES: dict[str, str] = {
    "cold": "cold (nothing cached)",
    "vllm": "again: vLLM's own prefix cache",
    "l1": "again, vLLM's cache emptied: kvstrata L1",
    "l2": "after a sidecar restart: kvstrata L2",
    "shared": "a new replica: kvstrata's shared tier",
}


@dataclass(frozen=True)
class Measurement:
    """One request: which case, its prompt's size, what kvstrata served, its TTFT."""

    case: str
    prompt_tokens: int
    hit_tokens_by_tier: dict[str, int]
    ttft_seconds: float

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())

    def row(self) -> str:
        tiers = ",".join(t for t, n in self.hit_tokens_by_tier.items() if n) or "-"
        return (
            f"  {CASES[self.case]:<42}{self.prompt_tokens:>8,}{self.hit_tokens:>10,}  "
            f"{tiers:<7}{self.ttft_seconds * 1e3:>7.0f} ms"
        )


HEADER = f"  {'case':<42}{'prompt':>8}{'kvstrata':>10}  {'tier':<7}{'TTFT':>10}"


@dataclass
class DemoResults:
    """Every measurement of a run, in order."""

    measurements: list[Measurement] = field(default_factory=list)

    def add(self, measurement: Measurement) -> None:
        self.measurements.append(measurement)

    def median_seconds(self, case: str) -> float | None:
        """The median TTFT of ``case``'s repeats (None: not measured)."""
        seconds = [m.ttft_seconds for m in self.measurements if m.case == case]
        return statistics.median(seconds) if seconds else None

    def missed(self, case: str) -> int:
        """How many of a kvstrata case's repeats kvstrata served nothing for."""
        return sum(1 for m in self.measurements if m.case == case and m.hit_tokens == 0)

    def summary(self) -> list[str]:
        """The lines after the table: medians, each against cold and vLLM's own cache."""
        cold = self.median_seconds("cold")
        own = self.median_seconds("vllm")
        repeats = sum(1 for m in self.measurements if m.case == "cold")
        lines = [f"medians of {repeats} repeat(s), each on a document of its own:"]
        if cold is None:
            return lines
        lines.append(f"  {CASES['cold']:<42}{cold * 1e3:>7.0f} ms")
        for case in ("vllm", "l1", "l2", "shared"):
            seconds = self.median_seconds(case)
            if seconds is None:
                continue
            against = f"{seconds / cold:.2f}x cold"
            if case != "vllm" and own:
                against += f", {seconds / own:.2f}x vLLM's own cache"
            missed = self.missed(case) if case != "vllm" else 0
            note = f"; kvstrata served nothing in {missed}" if missed else ""
            lines.append(f"  {CASES[case]:<42}{seconds * 1e3:>7.0f} ms  ({against}{note})")
        return lines
