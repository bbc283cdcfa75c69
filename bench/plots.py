"""The figures of ``bench serve`` and ``bench soak``, drawn from their committed JSON.

Why a module of its own: a figure is redrawn from ``bench/results/*.json``
without running the benchmark again (``python -m kvstrata.bench.plots``), and
what a figure shows is decided in one place for both the run and the redraw.

What a reader must not be misled by, and how each figure avoids it:

* ``serve.png``: the regimes do not share one workload. L1, L2 and Valkey
  serve the same prompts and share one vLLM-alone and one ceiling run, so those
  two are drawn once beside them. Multi-turn has its own. A new replica's first
  round is set against the cold vLLM alone and a warm replica's round, not
  against the ceiling (it computes no cold prefills, so it is not bounded by
  it). Bars only: the regimes are categories, not a series. Seconds on the log
  axis are written as seconds.
* ``soak.png``: the committed summary holds no per-request records, so the
  figure shows what the summary holds: the fault schedule over the run (one
  row per fault kind, a bar per injection from its first to its last request),
  the quiet points where the checks ran, and hit rate and TTFT fault-free
  against under faults, each a fraction or seconds as the JSON has it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COLORS = {
    "vllm": "#8c8c8c",
    "ceiling": "#2ca02c",
    "kvstrata": "#1f77b4",
    "warm": "#9ecae1",
    "sealed": "#17456e",  # kvstrata with encryption at rest: its plain regime's colour, darker
}


def _seconds_axis(ax: Any) -> None:
    """A log axis of seconds labelled as plain numbers (0.1, 0.3, 1, 3), not in powers of ten."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([0.03, 0.1, 0.3, 1, 3, 10]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _bars(ax: Any, labels: list[str], values: list[dict], colors: list[str], unit: str) -> None:
    """Bars at their medians with min-max whiskers, each labelled with its median."""
    for i, (value, color) in enumerate(zip(values, colors, strict=True)):
        med = value["median"]
        ax.bar(i, med, 0.7, color=color,
               yerr=[[med - value["min"]], [value["max"] - med]], capsize=3)  # fmt: skip
        ax.annotate(f"{med:.2f}{unit}", (i, value["max"]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(labels)), labels, fontsize=8)


def serve_figure(result: dict[str, Any]) -> Any:
    """``serve.png``'s figure: throughput (top) and TTFT p50 / p99 (bottom) per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = result["regimes"]
    plan = result["plan"]
    groups: list[tuple[str, list[tuple[str, str, dict]]]] = []
    shared = [g for g in ("l1", "l2", "l2_sealed", "valkey", "valkey_sealed") if g in regimes]
    if shared:
        base = regimes[shared[0]]
        names = {
            "l1": "L1 holds all",
            "l2": "L1 small,\nrest on disk",
            "l2_sealed": "L1 small,\ndisk, sealed",
            "valkey": "L1 small,\nrest Valkey",
            "valkey_sealed": "L1 small,\nValkey, sealed",
        }
        groups.append((
            f"{plan['num_prefixes']} prefixes x {plan['prefix_len']:,} tokens, "
            f"{plan['num_prompts']} prompts",
            [("vLLM\nalone", "vllm", base["vllm"]), ("ceiling", "ceiling", base["ceiling"])]
            + [
                (f"kvstrata\n{names[g]}", "sealed" if g.endswith("_sealed") else "kvstrata",
                 regimes[g]["kvstrata"])
                for g in shared
            ],
        ))  # fmt: skip
    if "multi_turn" in regimes:
        r = regimes["multi_turn"]
        groups.append((
            f"multi-turn: {plan['users']} users, {plan['rounds']} rounds",
            [("vLLM\nalone", "vllm", r["vllm"]), ("ceiling", "ceiling", r["ceiling"]),
             ("kvstrata", "kvstrata", r["kvstrata"])],
        ))  # fmt: skip
    if "new_replica" in regimes:
        r = regimes["new_replica"]
        bars = [("vLLM alone\n(cold)", "vllm", r["vllm"]),
                ("new replica,\nwarm Valkey", "kvstrata", r["kvstrata"])]  # fmt: skip
        if r.get("warm_replica"):
            bars.append(("a warm\nreplica", "warm", r["warm_replica"]))
        groups.append(("a new replica's first round", bars))
    widths = [len(bars) for _, bars in groups]
    fig, axes = plt.subplots(
        2, len(groups), figsize=(4.2 * len(groups) + 1, 7.5), squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )  # fmt: skip
    for col, (title, bars) in enumerate(groups):
        labels = [label for label, _, _ in bars]
        colors = [COLORS[kind] for _, kind, _ in bars]
        top, bottom = axes[0][col], axes[1][col]
        _bars(top, labels, [b["request_throughput"] for _, _, b in bars], colors, "")
        top.set_title(title, fontsize=9)
        top.set_ylim(0, max(b["request_throughput"]["max"] for _, _, b in bars) * 1.18)
        for i, (_, _, b) in enumerate(bars):
            for offset, pct, hatch in ((-0.18, "p50", ""), (0.18, "p99", "//")):
                bottom.bar(i + offset, b[f"ttft_{pct}_s"]["median"], 0.34,
                           color=colors[i], hatch=hatch, edgecolor="white")  # fmt: skip
        bottom.set_xticks(range(len(labels)), labels, fontsize=8)
        _seconds_axis(bottom)
        bottom.set_ylim(0.05, 10)
        if col == 0:
            top.set_ylabel("requests / s (median of runs, min-max)")
            bottom.set_ylabel("TTFT, seconds (log)")
    from matplotlib.patches import Patch

    axes[1][0].legend(
        handles=[Patch(facecolor="#bbbbbb", label="p50"),
                 Patch(facecolor="#bbbbbb", hatch="//", edgecolor="white", label="p99")],
        fontsize=8, loc="upper right",
    )  # fmt: skip
    machine = result.get("machine", {}).get("summary", "machine not recorded")
    fig.suptitle(
        "kvstrata bench serve: vLLM alone, the ceiling\n(vLLM with KV for the whole working set) "
        f"and kvstrata\nsame CPU binding for every server; {machine}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def soak_figure(result: dict[str, Any]) -> Any:
    """``soak.png``'s figure: the fault schedule over the run, and the run's figures
    fault-free against under faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = result["schedule"]
    kinds = sorted({f["kind"] for f in schedule["faults"]})
    fig = plt.figure(figsize=(12, 7))
    grid = fig.add_gridspec(2, 3, height_ratios=[2.2, 1])
    timeline = fig.add_subplot(grid[0, :])
    for row, kind in enumerate(kinds):
        spans = [(f["start"], max(f["end"] - f["start"], 60))
                 for f in schedule["faults"] if f["kind"] == kind]  # fmt: skip
        timeline.broken_barh(spans, (row - 0.35, 0.7), color="#d62728")
    for segment in schedule["segments"]:
        if not segment["faults"]:
            timeline.axvspan(segment["start"], segment["end"], color="#2ca02c", alpha=0.12)
    # Which shared tier the run used, written under the rows in each stretch.
    stretches: list[list[Any]] = []
    for segment in schedule["segments"]:
        if stretches and stretches[-1][0] == segment["shared"]:
            stretches[-1][2] = segment["end"]
        else:
            stretches.append([segment["shared"], segment["start"], segment["end"]])
    for shared, start, end in stretches:
        if start:
            timeline.axvline(start, color="k", linewidth=1)
        name = {"valkey": "Valkey", "s3": "S3"}.get(shared, shared)
        timeline.text((start + end) / 2, -1.0, f"shared tier: {name}", ha="center", fontsize=8)
    timeline.set_ylim(-1.5, len(kinds) - 0.4)
    for point in result["quiet_points"]:
        timeline.axvline(point["request"], color="#1f77b4", linestyle=":", linewidth=1)
    timeline.set_yticks(range(len(kinds)), [k.replace("_", " ") for k in kinds], fontsize=8)
    timeline.set_xlim(0, schedule["requests"])
    timeline.set_xlabel("request number")
    timeline.set_title(
        f"kvstrata bench soak, seed {result['seed']}: {result['requests']:,} requests, "
        f"{result['failed_requests']} failed, {result['differing_outputs']} differing outputs\n"
        "red: each fault injected, first to last request it spans (short ones widened to be "
        "seen); green: fault-free; blue dotted: quiet points where every check ran",
        fontsize=9,
    )
    hit = result["hit_rate"]
    ax = fig.add_subplot(grid[1, 0])
    ax.bar([0, 1], [hit["fault_free"], hit["under_faults"]], color=["#2ca02c", "#d62728"])
    ax.set_xticks([0, 1], ["fault-free", "under faults"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit tokens / prompt tokens")
    ax.set_title("kvstrata hit rate", fontsize=9)
    for i, v in enumerate([hit["fault_free"], hit["under_faults"]]):
        ax.annotate(f"{v:.2f}", (i, v), xytext=(0, 3), textcoords="offset points", ha="center")
    for col, pct in ((1, "p50"), (2, "p99")):
        ax = fig.add_subplot(grid[1, col])
        values = [result["ttft_fault_free_s"][pct], result["ttft_under_faults_s"][pct]]
        ax.bar([0, 1], values, color=["#2ca02c", "#d62728"])
        ax.set_xticks([0, 1], ["fault-free", "under faults"])
        ax.set_ylabel("seconds")
        ax.set_ylim(0, max(values) * 1.25)
        ax.set_title(f"TTFT {pct}", fontsize=9)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3f} s", (i, v), xytext=(0, 3), textcoords="offset points",
                        ha="center")  # fmt: skip
    fig.tight_layout()
    return fig


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Redraw ``serve.png``, ``serve-sealed.png`` and ``soak.png`` from the JSON
    in ``bench/results``."""
    directory = Path((argv or sys.argv[1:] or [str(RESULTS_DIR)])[0])
    figures = (("serve", serve_figure), ("serve-sealed", serve_figure), ("soak", soak_figure))
    for name, draw in figures:
        source = directory / f"{name}.json"
        if source.exists():
            save(draw(json.loads(source.read_text())), directory / f"{name}.png")
            print(f"wrote {directory / f'{name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
