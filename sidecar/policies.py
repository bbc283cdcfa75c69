"""Eviction policies of the L1 arena: LRU, LFU, FIFO, S3-FIFO, and a
prefix-aware wrapper.

Why plain classes: the engine owns memory and leases; a policy only orders
keys. Each one answers four calls (the engine makes them under its index
lock, so policies need no locking of their own):

* ``on_insert(key, size, parent=None)``: a chunk became resident; ``parent``
  is the previous chunk of the same prompt when known.
* ``on_access(key)``: a resident chunk was hit.
* ``on_remove(key)``: a chunk left L1 (evicted or removed). Unknown keys
  are ignored.
* ``victims()``: an iterator over resident keys, best victim first, each at
  most once. Between two ``next`` calls the engine may ``on_remove`` the key
  just yielded (it evicted it) or leave it (leased, skipped); the iterator
  copes with both and never yields a removed key.

Policies keep no state outside process memory.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice
from typing import Any

Key = Hashable

POLICY_NAMES = ("lru", "lfu", "fifo", "s3fifo")
_BATCH = 64


def _scan(order: OrderedDict[Any, Any]) -> Iterator[Any]:
    """Yield the keys of ``order`` front to back while the caller removes
    some of the yielded ones (the others stay at the front, in place)."""
    kept = 0  # yielded keys still present: they sit before the scan position
    while True:
        batch = list(islice(order, kept, kept + _BATCH))
        if not batch:
            return
        for key in batch:
            yield key
            if key in order:
                kept += 1


class EvictionPolicy(abc.ABC):
    """The interface the engine drives (see the module docstring)."""

    name: str

    @abc.abstractmethod
    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None: ...

    @abc.abstractmethod
    def on_access(self, key: Key) -> None: ...

    @abc.abstractmethod
    def on_remove(self, key: Key) -> None: ...

    @abc.abstractmethod
    def victims(self) -> Iterator[Key]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: Key) -> bool:
        raise NotImplementedError


class FIFOPolicy(EvictionPolicy):
    """Oldest insertion first; hits do not matter."""

    name = "fifo"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self._order[key] = None

    def on_access(self, key: Key) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Key]:
        return _scan(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order


class LRUPolicy(FIFOPolicy):
    """Least recently inserted or hit first."""

    name = "lru"

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class LFUPolicy(EvictionPolicy):
    """Fewest hits first; among equals, the least recently used.

    Buckets of equal frequency, each an LRU order: O(1) per event.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self.on_remove(key)
        self._freq[key] = 0
        self._buckets.setdefault(0, OrderedDict())[key] = None

    def on_access(self, key: Key) -> None:
        freq = self._freq.get(key)
        if freq is None:
            return
        self._unlink(key, freq)
        self._freq[key] = freq + 1
        self._buckets.setdefault(freq + 1, OrderedDict())[key] = None

    def on_remove(self, key: Key) -> None:
        freq = self._freq.pop(key, None)
        if freq is not None:
            self._unlink(key, freq)

    def _unlink(self, key: Key, freq: int) -> None:
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]

    def victims(self) -> Iterator[Key]:
        for freq in sorted(self._buckets):
            bucket = self._buckets.get(freq)
            if bucket is not None:
                yield from _scan(bucket)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO and a ghost FIFO.

    * Insert: into main if the key is in the ghost queue (it was evicted
      from small recently and came back), else into small. Frequency 0.
    * Hit: frequency += 1, capped at 3.
    * Evict from small while small holds >= ``small_ratio`` of the capacity
      (or main has nothing left): its oldest entry moves to main when it was
      hit at least ``move_to_main_threshold`` times, else it is the victim
      and its key goes to the ghost queue.
    * Evict from main: the oldest entry with frequency > 0 is reinserted at
      the head with frequency - 1; one with frequency 0 is the victim.
    * The ghost queue remembers as many keys as main holds entries.

    A victim the engine skips (leased) is treated like a hit in main:
    reinserted at main's head, so the scan moves on.
    """

    name = "s3fifo"

    def __init__(
        self, capacity_bytes: int, small_ratio: float = 0.1, move_to_main_threshold: int = 1
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.small_ratio = small_ratio
        self.move_to_main_threshold = move_to_main_threshold
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self.small_bytes = 0
        self._candidate: Key | None = None

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self.on_remove(key)
        self._freq[key] = 0
        self._size[key] = size
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self.small_bytes += size

    def on_access(self, key: Key) -> None:
        freq = self._freq.get(key)
        if freq is not None:
            self._freq[key] = min(freq + 1, 3)

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        size = self._size.pop(key)
        if key in self._small:
            del self._small[key]
            self.small_bytes -= size
            if key == self._candidate:  # evicted from small: remember it
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._main), 1):
                    self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)
        if key == self._candidate:
            self._candidate = None

    def _to_main(self, key: Key, freq: int) -> None:
        if key in self._small:
            del self._small[key]
            self.small_bytes -= self._size[key]
        else:
            del self._main[key]
        self._main[key] = None
        self._freq[key] = freq

    def victims(self) -> Iterator[Key]:
        skipped: set[Key] = set()
        while True:  # ends when every resident key was offered (or removed)
            key = self._next_candidate(skipped)
            if key is None:
                return
            self._candidate = key
            yield key
            if key in self._freq:  # the engine kept it (leased)
                skipped.add(key)
                self._to_main(key, self._freq[key])
            self._candidate = None

    def _next_candidate(self, skipped: set[Key]) -> Key | None:
        # Each loop either returns or demotes one frequency unit, so it ends.
        while True:
            main_key = next((k for k in self._main if k not in skipped), None)
            if self._small and (
                main_key is None or self.small_bytes >= self.small_ratio * self.capacity_bytes
            ):
                key = next(iter(self._small))
                if self._freq[key] >= self.move_to_main_threshold:
                    self._to_main(key, 0)
                    continue
                return key
            if main_key is None:
                return None
            freq = self._freq[main_key]
            if freq > 0:
                self._to_main(main_key, freq - 1)
                continue
            return main_key

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq


class PrefixAwarePolicy(EvictionPolicy):
    """Wraps a policy so a chain's tail goes before its head.

    A chunk whose child (the next chunk of some prompt) is still resident is
    deferred: a tail without its head can never hit, so evicting the head
    first would waste the tail. A deferred chunk is offered right after its
    last resident child is evicted; if the inner order runs out, the
    deferred ones follow in order (their children are leased).
    """

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self._parent: dict[Key, Key] = {}
        self._children: dict[Key, set[Key]] = {}

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self.inner:  # a re-insert: forget its old links (rare; keeps the hot path short)
            self.on_remove(key)
        self.inner.on_insert(key, size, parent)
        if parent is not None and parent != key and parent in self.inner:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)

    def on_access(self, key: Key) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: Key) -> None:
        self.inner.on_remove(key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
        for child in self._children.pop(key, ()):
            self._parent.pop(child, None)

    def has_resident_child(self, key: Key) -> bool:
        return key in self._children

    def victims(self) -> Iterator[Key]:
        deferred: dict[Key, None] = {}  # insertion-ordered: policy order
        for key in self.inner.victims():
            if key not in self.inner:
                continue
            if key in self._children:
                deferred[key] = None
                continue
            # Evicting a leaf may free its parent, then the grandparent...:
            # unwind the chain at once, tail first (O(1) per step).
            while True:
                parent = self._parent.get(key)
                yield key
                if key in self.inner or parent not in deferred or parent in self._children:
                    break
                del deferred[parent]
                key = parent
        for key in deferred:  # their children are leased: heads go after all
            if key in self.inner:
                yield key

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: Key) -> bool:
        return key in self.inner


def make_policy(name: str, capacity_bytes: int, prefix_aware: bool = False) -> EvictionPolicy:
    """The policy ``l1.policy`` names, wrapped for ``l1.prefix_aware``."""
    policy: EvictionPolicy
    if name == "lru":
        policy = LRUPolicy()
    elif name == "lfu":
        policy = LFUPolicy()
    elif name == "fifo":
        policy = FIFOPolicy()
    elif name == "s3fifo":
        policy = S3FIFOPolicy(capacity_bytes)
    else:
        raise ValueError(f"l1.policy: unknown policy {name!r}; expected one of {POLICY_NAMES}")
    return PrefixAwarePolicy(policy) if prefix_aware else policy
