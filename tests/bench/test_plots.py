"""The committed serve and soak figures, drawn from the committed JSON, say
what the JSON says and nothing a reader would misread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from kvstrata.bench.plots import RESULTS_DIR, serve_figure, soak_figure  # noqa: E402


def committed(name: str) -> dict:
    return json.loads((RESULTS_DIR / f"{name}.json").read_text())


def texts(fig) -> list[str]:
    fig.canvas.draw()
    out = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    return [t for t in out if t]


def test_the_soak_hit_rate_is_a_fraction_and_equals_the_summary():
    result = committed("soak")
    fig = soak_figure(result)
    (rate_axes,) = [ax for ax in fig.axes if ax.get_title() == "kvstrata hit rate"]
    heights = [p.get_height() for p in rate_axes.patches]
    assert heights == [result["hit_rate"]["fault_free"], result["hit_rate"]["under_faults"]]
    assert all(0 <= h <= 1 for h in heights)


def test_the_soak_figure_says_what_each_mark_means():
    fig = soak_figure(committed("soak"))
    title = " ".join(texts(fig))
    for meaning in ("red: each fault injected", "green: fault-free", "blue dotted: quiet points"):
        assert meaning in title


def test_serve_draws_no_modelled_line_and_joins_no_categories():
    fig = serve_figure(committed("serve"))
    assert not any("ideal" in t for t in texts(fig))
    for ax in fig.axes:
        # Error-bar caps are one-point lines; anything longer is a series or a model line.
        assert all(len(line.get_xdata()) <= 1 for line in ax.get_lines()), ax.get_title()


def test_serve_sets_a_new_replica_against_cold_and_warm_replicas_not_the_ceiling():
    fig = serve_figure(committed("serve"))
    (replica,) = [ax for ax in fig.axes if ax.get_title() == "a new replica's first round"]
    labels = [t.get_text() for t in replica.get_xticklabels()]
    assert not any("ceiling" in label for label in labels)
    # vLLM alone and the ceiling of the shared workload appear once, not in every regime.
    ticks = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
    assert ticks.count("ceiling") == 2 * 2  # shared workload and multi-turn, both rows


def test_serve_labels_its_log_axis_in_seconds_not_powers_of_ten():
    fig = serve_figure(committed("serve"))
    labels = texts(fig)
    assert not any("10^" in t or "\\times" in t or "\N{MULTIPLICATION SIGN}" in t for t in labels)
    assert "0.3" in labels and "3" in labels


def test_the_figures_are_redrawn_from_a_results_directory(tmp_path: Path):
    from kvstrata.bench.plots import main

    for name in ("serve", "soak"):
        (tmp_path / f"{name}.json").write_text((RESULTS_DIR / f"{name}.json").read_text())
    assert main([str(tmp_path)]) == 0
    for name in ("serve", "soak"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
