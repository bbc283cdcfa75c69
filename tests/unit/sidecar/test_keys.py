"""Chunk keys: parity with vLLM's block-hash chain, stability across
processes, and namespace fingerprints."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from kvstrata.sidecar.keys import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    Namespace,
    chunk_keys_from_block_hashes,
    iter_prefix,
    make_key,
)

BLOCK = 16


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 150_000) for _ in range(n)]


def vllm_names(module: str, *names: str) -> list[Any]:
    """``names`` from a vLLM module. Without vLLM the parity checks skip; with
    it, a moved or renamed name fails: that drift is what they exist to catch."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: no parity check")
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"vLLM has no module {module} any more ({exc}): re-check keys.py against it")
    missing = [name for name in names if not hasattr(found, name)]
    if missing:
        pytest.fail(f"vLLM moved {missing} out of {module}: re-check keys.py against it")
    return [getattr(found, name) for name in names]


@pytest.fixture(scope="module")
def vllm_hash():
    """vLLM's own chain function, initialised the way vLLM does at start."""
    init_none_hash, hash_block_tokens = vllm_names(
        "vllm.v1.core.kv_cache_utils", "init_none_hash", "hash_block_tokens"
    )
    (sha256_cbor,) = vllm_names("vllm.utils.hashing", "sha256_cbor")

    init_none_hash(sha256_cbor)

    def chain(tokens, cache_salt=None, lora=None):
        out, parent = [], None
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            extra = []
            if lora is not None:
                extra.append(("lora", *lora))
            if cache_salt and start == 0:
                extra.append(("cache_salt", cache_salt))
            parent = hash_block_tokens(
                sha256_cbor, parent, tokens[start : start + BLOCK], tuple(extra) or None
            )
            out.append(bytes(parent))
        return out

    return chain


@pytest.mark.vllm
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("cache_salt", "lora"),
    [(None, None), ("tenant-a", None), (None, ("adapter", "/loras/a")), ("s", ("l", "/p"))],
    ids=["plain", "cache_salt", "lora", "both"],
)
def test_block_hasher_equals_vllms_chain(vllm_hash, seed, cache_salt, lora):
    rng = random.Random(seed)
    tokens = random_tokens(rng, rng.randint(BLOCK, 20 * BLOCK))
    ours = BlockHasher(BLOCK).hash_blocks(tokens, cache_salt=cache_salt, lora=lora)
    assert ours == vllm_hash(tokens, cache_salt=cache_salt, lora=lora)
    assert len(ours) == len(tokens) // BLOCK


@pytest.mark.vllm
def test_the_none_hash_seed_matches_vllms_default():
    (theirs,) = vllm_names("vllm.v1.core.kv_cache_utils", "DEFAULT_NONE_HASH_SEED")
    assert theirs == DEFAULT_NONE_HASH_SEED


def test_cache_salt_and_lora_change_every_hash():
    tokens = list(range(4 * BLOCK))
    h = BlockHasher(BLOCK)
    plain = h.hash_blocks(tokens)
    salted = h.hash_blocks(tokens, cache_salt="x")
    lora = h.hash_blocks(tokens, lora=("a", "/a"))
    assert all(len({a, b, c}) == 3 for a, b, c in zip(plain, salted, lora, strict=True))


_CHILD = (
    "import json, sys; from kvstrata.sidecar.keys import BlockHasher;"
    "print(json.dumps([h.hex() for h in BlockHasher(16).hash_blocks(json.loads(sys.argv[1]))]))"
)


def hashes_in_subprocess(tokens: list[int], pythonhashseed: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(tokens)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_hashes_are_stable_across_processes():
    tokens = random_tokens(random.Random(7), 8 * BLOCK)
    unset_a = hashes_in_subprocess(tokens, None)
    unset_b = hashes_in_subprocess(tokens, None)  # different str-hash randomisation
    assert unset_a == unset_b
    expected = [
        h.hex() for h in BlockHasher(BLOCK, seed=DEFAULT_NONE_HASH_SEED).hash_blocks(tokens)
    ]
    assert unset_a == expected
    seeded = hashes_in_subprocess(tokens, "1234")
    assert seeded == hashes_in_subprocess(tokens, "1234")
    assert seeded == [h.hex() for h in BlockHasher(BLOCK, seed="1234").hash_blocks(tokens)]
    assert seeded != unset_a  # like vLLM, PYTHONHASHSEED seeds the chain


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Namespace)])
def test_namespace_fingerprint_differs_when_any_field_differs(field):
    base = Namespace(model="m")
    value = getattr(base, field)
    changed = value + 1 if isinstance(value, int) else value + "-other"
    other = dataclasses.replace(base, **{field: changed})
    assert base.fingerprint() != other.fingerprint()
    assert len(base.fingerprint()) == 16
    assert base.fingerprint() == Namespace(model="m").fingerprint()


def test_chunk_keys_take_the_last_block_of_each_full_chunk():
    fp = Namespace(model="m").fingerprint()
    hashes = [bytes([i]) * 32 for i in range(10)]
    keys = chunk_keys_from_block_hashes(fp, hashes, 4)
    assert keys == [fp + hashes[3], fp + hashes[7]]
    with pytest.raises(ValueError):
        chunk_keys_from_block_hashes(fp, hashes, 0)
    with pytest.raises(ValueError):
        make_key(b"short", hashes[0])


def test_iter_prefix_counts_the_leading_run():
    assert iter_prefix("abcd", [True, True, False, True]) == 2
    assert iter_prefix("ab", []) == 0


@pytest.mark.vllm
def test_a_name_vllm_moved_fails_the_parity_checks_instead_of_skipping_them():
    with pytest.raises(pytest.fail.Exception, match="moved"):
        vllm_names("vllm.v1.core.kv_cache_utils", "hash_block_tokens", "a_name_vllm_never_had")
    with pytest.raises(pytest.fail.Exception, match="no module"):
        vllm_names("vllm.v1.core.a_module_vllm_never_had", "hash_block_tokens")
