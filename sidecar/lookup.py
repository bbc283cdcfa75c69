"""Lookup: the longest prefix of a prompt's chunks some tier holds.

Why apart from the engine: the prefix walk over L1, L2 and the shared tier
and its per-tier denominators (``asked``) are a read-only question asked on
every scheduler step; the engine answers it through this object, which
asks the L1 index (:mod:`.l1index`, one question per run of chunks L1
holds), L2 through its tier interface, and the shared tier with no lock held.
Its counts go to the index's counters.

The answer is a moment's: a chunk may be evicted or land right after the
walk passed it, as it may right after the answer is sent. Only its
consistency with a retrieve matters, and a retrieve asks again.

A chunk counts for what a retrieve of it would get: a full-chunk key
holding a partial chunk (its header's block count is not 0) is no hit, and
a partial candidate holding a full chunk is none either (see
:mod:`.partials`). L1 and L2 know each object's header; the shared tier is
asked for existence only, so its objects are taken at their key's word.

A request may name the tiers it loads from (:mod:`.tierchoice`): the walk
then neither consults nor counts the others, so a chunk held only in an
excluded tier is a miss for that request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.partials import is_partial
from kvstrata.sidecar.tierchoice import TierChoice, allows
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier

__all__ = ["LookupResult", "PrefixLookup"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prompt's chunk list some tier holds."""

    hit_chunks: int  # longest contiguous prefix present in any tier
    tiers: list[str]  # per hit chunk: "l1" | "l2" | the shared tier's name
    # Chunks each tier was consulted for: those the prefix walk reached it with
    # (not found in a faster tier, before the first chunk no tier holds). A
    # tier's hit rate is its hits over this, exactly.
    asked: dict[str, int] = field(default_factory=dict)


class PrefixLookup:
    """The prefix walk of one engine (see the module docstring)."""

    def __init__(
        self,
        index: L1Index,
        l2: DiskTier | None,
        shared: Tier | None,
    ) -> None:
        self._index = index
        self.l2 = l2
        self.shared = shared

    def lookup(
        self, keys: Sequence[ChunkKey], fetch_ahead: bool = False, tiers: TierChoice = None
    ) -> LookupResult:
        """Longest contiguous prefix of ``keys`` present in any tier ``tiers`` allows.

        The shared tier's batched existence check asks for what the local
        tiers lack, and they are asked again after it. ``fetch_ahead``: the caller fetches
        the prefix found next, so the shared tier may start fetching with
        the question (:meth:`Tier.contains_many_ahead`)."""
        local = [t for t in ("l1", "l2") if allows(tiers, t) and (t == "l1" or self.l2)]
        asked = dict.fromkeys(local, 0)
        found = self._walk_local(keys, asked, tiers)
        if len(found) == len(keys) or self.shared is None or not allows(tiers, "shared"):
            self._count_lookup(keys, found)
            return LookupResult(len(found), found, asked)
        rest = keys[len(found) :]
        try:
            if fetch_ahead:
                remote = self.shared.contains_many_ahead(rest)
            else:
                remote = self.shared.contains_many(rest)
        except Exception:  # a tier must not raise; a failure is a miss
            logger.exception("shared tier %s raised from contains_many", self.shared.name)
            remote = []
        name = self.shared.name
        asked[name] = 0
        # Re-check the local tiers: a chunk may have landed while the remote
        # round trip ran (the first was counted by the local walk).
        for i, (key, there) in enumerate(zip(rest, remote, strict=False)):
            tier = self._local_tier(key, asked if i > 0 else None, tiers=tiers)
            if tier is None and self._held_locally(key, tiers):
                break  # here, but not as a full chunk: the shared copy is no better
            if tier is None:
                asked[name] += 1
                tier = name if there else None
            if tier is None:
                break
            found.append(tier)
        self._count_lookup(keys, found)
        return LookupResult(len(found), found, asked)

    def _walk_local(
        self, keys: Sequence[ChunkKey], asked: dict[str, int], tiers: TierChoice
    ) -> list[str]:
        """The tiers of the longest prefix of ``keys`` L1 and L2 hold as full
        chunks; each run of chunks L1 holds is one question to the index."""
        found: list[str] = []
        use_l1 = allows(tiers, "l1")
        while len(found) < len(keys):
            if use_l1:
                run = self._index.ready_run(keys, len(found))
                found += ["l1"] * run
                if len(found) == len(keys):
                    asked["l1"] += run
                    break
                asked["l1"] += run + 1  # and the one it lacks
            tier = self._l2_tier(keys[len(found)], asked, False, tiers)
            if tier is None:
                break
            found.append(tier)
        return found

    def first_present(
        self, keys: Sequence[ChunkKey], tiers: TierChoice = None
    ) -> tuple[int, str] | None:
        """(index, tier) of the first of ``keys`` any tier ``tiers`` allows holds, or
        None (for partial chunks: candidates longest first). Not counted as a lookup."""
        if not keys:
            return None
        for i, key in enumerate(keys):
            tier = self._local_tier(key, None, partial=True, tiers=tiers)
            if tier is not None:
                return i, tier
        if self.shared is None or not allows(tiers, "shared"):
            return None
        try:
            remote = self.shared.contains_many(keys)
        except Exception:  # a tier must not raise; a failure is a miss
            logger.exception("shared tier %s raised from contains_many", self.shared.name)
            return None
        for i, there in enumerate(remote):
            if there:
                return i, self.shared.name
        return None

    def _local_tier(
        self,
        key: ChunkKey,
        asked: dict[str, int] | None,
        partial: bool = False,
        tiers: TierChoice = None,
    ) -> str | None:
        """ "l1", "l2" or None for ``key`` held as a full chunk (as a partial one
        with ``partial``) in a tier ``tiers`` allows; counts the tiers
        consulted into ``asked`` (unless None)."""
        if allows(tiers, "l1"):
            if asked is not None:
                asked["l1"] += 1
            if self._index.ready_run((key,), partial=partial):
                return "l1"
        return self._l2_tier(key, asked, partial, tiers)

    def _l2_tier(
        self, key: ChunkKey, asked: dict[str, int] | None, partial: bool, tiers: TierChoice
    ) -> str | None:
        """ "l2" when L2 holds ``key`` (as a partial chunk with ``partial``) and
        ``tiers`` allows it, else None; counted into ``asked`` when L2 is asked."""
        if self.l2 is None or not allows(tiers, "l2"):
            return None
        if asked is not None:
            asked["l2"] += 1
        info = self.l2.peek(key)
        return "l2" if info is not None and is_partial(info.meta) == partial else None

    def _held_locally(self, key: ChunkKey, tiers: TierChoice = None) -> bool:
        """Whether L1 or L2 (those ``tiers`` allows) holds ``key`` in any form."""
        in_l1 = allows(tiers, "l1") and self._index.holds(key)
        in_l2 = allows(tiers, "l2") and self.l2 is not None and self.l2.contains(key)
        return in_l1 or in_l2

    def _count_lookup(self, keys: Sequence[ChunkKey], tiers: list[str]) -> None:
        with self._index.tally() as counts:
            counts.lookups_total += 1
            counts.lookup_chunks_total += len(keys)
            hits = counts.hit_chunks_total
            for tier in set(tiers):
                hits[tier] = hits.get(tier, 0) + tiers.count(tier)
