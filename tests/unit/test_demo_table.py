"""What ``kvstrata demo`` prints about its measurements (no vLLM started)."""

from __future__ import annotations

from kvstrata.demo_table import DemoResults, Measurement


def results(ttfts: dict[str, list[float]], missed: tuple[str, ...] = ()) -> DemoResults:
    out = DemoResults()
    for case, seconds in ttfts.items():
        for i, s in enumerate(seconds):
            hits = {} if case in ("cold", "vllm") or (case in missed and i == 0) else {"l1": 2048}
            out.add(Measurement(case, 2080, hits, s))
    return out


def test_each_case_is_summarised_by_the_median_of_its_repeats_not_one_sample():
    run = results({"cold": [0.9, 0.7, 2.0], "vllm": [0.05, 0.04, 0.3], "l1": [2.1, 0.15, 0.16]})
    assert run.median_seconds("l1") == 0.16  # the 2.1 s outlier is not what is reported
    text = "\n".join(run.summary())
    assert "medians of 3 repeat(s)" in text
    assert "kvstrata L1" in text and "160 ms" in text


def test_kvstrata_is_set_against_vllms_own_prefix_cache_as_well_as_cold():
    run = results({"cold": [1.0], "vllm": [0.1], "l1": [0.2]})
    (l1_line,) = [line for line in run.summary() if "kvstrata L1" in line]
    assert "0.20x cold" in l1_line
    assert "2.00x vLLM's own cache" in l1_line
    (own,) = [line for line in run.summary() if "vLLM's own prefix cache" in line]
    assert "vLLM's own cache" not in own.split("(")[1]  # not compared with itself


def test_a_repeat_that_kvstrata_served_nothing_for_is_said():
    run = results({"cold": [1.0, 1.0], "l2": [0.9, 0.2]}, missed=("l2",))
    assert run.missed("l2") == 1
    (l2_line,) = [line for line in run.summary() if "L2" in line]
    assert "served nothing in 1" in l2_line


def test_a_case_not_measured_is_left_out_of_the_summary():
    run = results({"cold": [1.0], "l1": [0.2]})
    text = "\n".join(run.summary())
    assert "shared tier" not in text and "L2" not in text


def test_a_row_names_the_tier_that_served_and_the_hit_tokens():
    row = Measurement("l2", 2078, {"l2": 2048}, 0.137).row()
    assert "after a sidecar restart" in row
    assert "2,048" in row and "l2" in row and "137 ms" in row
