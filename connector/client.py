"""The connector's client of its sidecar: the operations it asks for and checks of their answers.

Why a module of its own: the vLLM connector must treat the cache as
optional. Every operation here answers None/False on any sidecar problem,
counting why in :attr:`SidecarClient.errors`; it never raises and never
hangs. How a request reaches the sidecar (HELLO, deadlines, retries,
back-off, the arena mapping, the liveness watch) is
:class:`~kvstrata.connector.session.SidecarSession`'s; here each operation
builds its request, checks its own arguments, and refuses a reply that
disagrees with what was asked (counted as ``bad_reply``): a slot outside
the arena, a hit count past the keys. The connector only decides what to
load and store.

No vLLM or kopf imports here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.connector.client_arena import ArenaSlot, slots_in_arena
from kvstrata.connector.session import SidecarSession
from kvstrata.connector.transport import CurveKeys
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey

# ArenaSlot and CurveKeys are part of this client's signatures: importable from here.
__all__ = ["ArenaSlot", "CurveKeys", "SidecarClient"]


class SidecarClient(SidecarSession):
    """The operations on the sidecar (module docstring); each returns
    None/False on any sidecar problem. Constructed as :class:`SidecarSession`."""

    # -- ops ----------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        prefetch: bool,
        owner: str,
        groups: int = 1,
        partials: Sequence[Sequence[ChunkKey]] = (),
        load_tiers: frozenset[str] | None = None,
    ) -> p.LookupReply | None:
        """Longest stored prefix of ``keys``; with ``prefetch`` the sidecar starts
        bringing it into L1, pinned for ``owner`` until :meth:`end_request`.

        With ``groups`` > 1, ``keys`` are that many equal runs (one per
        namespace, each named at HELLO) and the answer is the prefix every
        run holds; then ``keys`` must fit in one request (``MAX_KEYS``).
        ``partials[i]`` (one namespace only): candidate partial chunks after
        ``i`` full chunks, longest first; the reply's ``partial`` indexes
        ``partials[hit_chunks]``. ``load_tiers``: the only tiers to look in
        (``kvstrata.sidecar.tierchoice``; None: every tier)."""
        if groups > 1 and (len(keys) % groups or len(keys) > p.MAX_KEYS or partials):
            self._count("bad_argument")
            return None
        body = p.LookupRequest(
            keys=list(keys[: p.MAX_KEYS]),
            prefetch=prefetch,
            owner=owner,
            groups=groups,
            partials=[list(c[: p.MAX_KEYS]) for c in partials[: p.MAX_KEYS]],
            load_tiers=load_tiers,
        )
        reply = self._call(p.LOOKUP, body)
        if not isinstance(reply, p.LookupReply):
            return None
        if reply.hit_chunks > len(body.keys) // groups or len(reply.tiers) != reply.hit_chunks:
            return self._bad_reply(p.LOOKUP, "hit count disagrees with tiers")
        if reply.partial >= 0 and (
            reply.hit_chunks >= len(body.partials)
            or reply.partial >= len(body.partials[reply.hit_chunks])
        ):
            return self._bad_reply(p.LOOKUP, "partial chunk out of range")
        return reply

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        nbytes: int,
        dtype: str,
        shape: tuple[int, ...],
        owner: str,
        blocks: int = 0,
        covers: Sequence[ChunkKey] = (),
        tenant: str = "",
        store_tiers: frozenset[str] | None = None,
    ) -> list[ArenaSlot | None] | None:
        """Write slots, one per key; a None entry means skip that chunk
        (already stored or no space). Commit with :meth:`commit_store`.
        ``blocks``: 0 for full chunks, else the block count of partial ones;
        ``covers``: partial chunks these keys supersede (the sidecar drops them);
        ``tenant``: the chunks' tenant, one of :attr:`tenants` ("": the default);
        ``store_tiers``: the only tiers the chunks may go to (None: every tier)."""
        body = p.PrepareStoreRequest(
            keys=list(keys[: p.MAX_KEYS]),
            nbytes=nbytes,
            dtype=dtype,
            shape=tuple(shape),
            owner=owner,
            blocks=blocks,
            covers=list(covers[: p.MAX_KEYS]),
            tenant=tenant,
            store_tiers=store_tiers,
        )
        return self._slots(p.PREPARE_STORE, body, len(keys))

    def commit_store(self, lease_ids: Sequence[int], ok: Sequence[bool]) -> bool:
        """Publish (``ok``) or abandon each written slot; True when every slot
        marked ok was committed."""
        if len(lease_ids) != len(ok):
            self._count("bad_argument")
            return False
        body = p.CommitStoreRequest(lease_ids=[int(i) for i in lease_ids], ok=[bool(o) for o in ok])
        reply = self._call(p.COMMIT_STORE, body)
        if not isinstance(reply, p.CommitStoreReply):
            return False
        committed = reply.committed
        if len(committed) != len(lease_ids):
            self._bad_reply(p.COMMIT_STORE, "wrong number of results")
            return False
        if any(want and not done for want, done in zip(ok, committed, strict=True)):
            self._count("commit_refused")
            return False
        return True

    def prepare_retrieve(
        self,
        keys: Sequence[ChunkKey],
        owner: str,
        runs: Sequence[int] = (),
        blocks: int = 0,
        load_tiers: frozenset[str] | None = None,
    ) -> list[ArenaSlot | None] | None:
        """Read slots, one per key (None = miss; every entry after the first
        miss is None, within each of ``runs`` when given: consecutive key
        counts, e.g. one per request of a step). Give them back with
        :meth:`release`. Each object must hold ``blocks`` blocks (0: full
        chunks), or it is a miss. ``load_tiers``: the only tiers below L1 a
        chunk may be promoted from (None: every tier)."""
        if runs and (sum(runs) != len(keys) or len(keys) > p.MAX_KEYS or min(runs) < 1):
            self._count("bad_argument")
            return None
        body = p.PrepareRetrieveRequest(
            keys=list(keys[: p.MAX_KEYS]),
            owner=owner,
            runs=[int(n) for n in runs],
            blocks=blocks,
            load_tiers=load_tiers,
        )
        return self._slots(p.PREPARE_RETRIEVE, body, len(keys))

    def release(self, lease_ids: Sequence[int]) -> bool:
        reply = self._call(p.RELEASE, p.ReleaseRequest(lease_ids=[int(i) for i in lease_ids]))
        return isinstance(reply, p.CountReply)

    def end_request(self, owner: str) -> bool:
        """Drop every lease (prefetch pins included) held for ``owner``."""
        reply = self._call(p.END_REQUEST, p.EndRequestRequest(owner=owner))
        return isinstance(reply, p.CountReply)

    def ping(self) -> bool:
        reply = self._call(p.PING, p.PingRequest())
        return isinstance(reply, p.PingReply)

    def stats(self) -> dict | None:
        reply = self._call(p.STATS, p.StatsRequest())
        return reply.stats if isinstance(reply, p.StatsReply) else None

    def events(self, after: int, limit: int = p.MAX_EVENTS) -> p.EventsReply | None:
        """The sidecar's tier changes of our namespace after ``after`` (KV events)."""
        reply = self._call(p.EVENTS, p.EventsRequest(after=after, limit=limit))
        return reply if isinstance(reply, p.EventsReply) else None

    def _slots(self, op: str, body: p.Message, n: int) -> list[ArenaSlot | None] | None:
        reply = self._call(op, body)
        if not isinstance(reply, p.SlotsReply):
            return None
        arena = self._arena
        if arena is None:
            return self._bad_reply(op, "wrong number of slots")
        try:
            return slots_in_arena(reply.slots, n, arena.size)
        except ValueError as exc:
            return self._bad_reply(op, str(exc))
