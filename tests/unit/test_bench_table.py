"""The benchmark table: ratios, goals and whether they are met, medians, the rendering."""

import json

import pytest

from bench.table import goal, median, percentile, render, row


def test_ratio_is_value_over_baseline():
    r = row("reaction", 0.3, "s", baseline=0.1)
    assert r.ratio == 3.0
    assert r.goal == "" and r.met is None


@pytest.mark.parametrize("baseline", [None, 0])
def test_no_ratio_without_a_baseline(baseline):
    assert row("x", 5, "steps", baseline=baseline).ratio is None


def test_every_bound_must_hold():
    target = goal("value <= 0.5", "ratio <= 1.5")
    assert row("r", 0.2, "s", 0.15, target).met is True
    assert row("r", 0.4, "s", 0.15, target).met is False  # under 0.5 s, but 2.7x the baseline
    assert row("r", 0.6, "s", 0.5, target).met is False  # 1.2x, but over 0.5 s


def test_faster_by_a_factor_reads_as_a_small_ratio():
    target = goal("ratio <= 0.05", note="20x faster")
    assert row("resume", 13.0, "s", 330.0, target).met is True
    assert row("resume", 20.0, "s", 330.0, target).met is False
    assert target.text("s") == "≤ 0.05x baseline (20x faster)"


def test_a_bound_against_the_baseline_itself():
    no_larger = goal("value <= baseline")
    assert row("lost", 3, "steps", 3, no_larger).met is True
    assert row("lost", 0, "steps", 0, no_larger).met is True  # a ratio of 0/0 does not matter
    assert row("lost", 4, "steps", 3, no_larger).met is False


def test_a_goal_that_cannot_be_judged_is_not_met_nor_missed():
    assert row("lost", 2, "steps", None, goal("value <= baseline")).met is None
    assert row("t", 2, "s", None, goal("value <= 3", "ratio <= 1.5")).met is None
    assert row("t", 4, "s", None, goal("value <= 3", "ratio <= 1.5")).met is False  # one bound fails anyway


def test_exact_goals():
    assert row("incidents", 500, "", 500, goal("value == baseline")).met is True
    assert row("lost", 0, "steps", 2, goal("value == 0")).met is True
    assert row("lost", 1, "steps", 2, goal("value == 0")).met is False


def test_goal_text_carries_the_unit():
    assert goal("value >= 50").text("nodes/s") == "≥ 50 nodes/s"
    assert goal("value <= 1024").text("MiB") == "≤ 1,024 MiB"
    assert goal("value <= 0.5", "ratio <= 1.5", note="anchor").text("s") == "≤ 0.5 s and ≤ 1.5x baseline (anchor)"


def test_json_row_has_exactly_the_promised_keys():
    r = row("scale N=10 (scale harness, not real Slurm)", 12.345678, "nodes/s", 500.0, goal("value >= 50"), digits=1)
    data = json.loads(json.dumps(r.as_json()))
    assert list(data) == ["name", "value", "unit", "baseline", "ratio", "goal", "met"]
    assert data["value"] == 12.3 and data["met"] is False and data["ratio"] == 0.025


def test_median_and_percentile():
    assert median([3, None, 1, 2]) == 2
    assert median([None]) is None
    assert percentile([0.1, 0.2, 0.3, 0.4, 10.0], 0.5) == 0.3
    assert percentile([0.1, 0.2, 0.3, 0.4, 10.0], 0.99) == 10.0


def test_render_aligns_and_marks_misses():
    text = render(
        [
            row("reaction p50", 0.224, "s", 0.043, goal("value <= 0.5", "ratio <= 1.5")),
            row("storm incidents", 500, "", 500, goal("value == baseline")),
        ]
    )
    lines = text.splitlines()
    assert lines[0].split() == ["benchmark", "value", "baseline", "ratio", "goal", "met"]
    assert "0.224 s" in lines[2] and "5.21x" in lines[2] and lines[2].endswith("NO")
    assert lines[3].endswith("yes")
    second_column = lines[1].index(" -") + 1  # the rule under the header marks each column
    assert [line[:second_column].rstrip() for line in lines[2:]] == ["reaction p50", "storm incidents"]
