"""The budget's policy as configured: its bounds, and the partition fractions' text form."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from contracts.budget import BudgetPolicy, partition_fractions_from


def test_partition_fractions_from_text():
    assert partition_fractions_from("") == {}
    assert partition_fractions_from(" gpu=0.2, debug = 0.5 ,") == {"gpu": 0.2, "debug": 0.5}


@pytest.mark.parametrize("text", ["gpu", "gpu=", "gpu=half", "=0.2x"])
def test_a_malformed_partition_fraction_is_refused_with_its_text(text):
    with pytest.raises(ValueError, match=f"partition fraction {text!r}: use NAME=FRACTION"):
        partition_fractions_from(text)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_nodes": 0},
        {"partition_fraction": 0},
        {"partition_fraction": 1.5},
        {"partition_fractions": {"gpu": 0}},
        {"partition_fractions": {"gpu[1]": 0.2}},
        {"max_disrupted_jobs": 0},
        {"lemon_incidents": 1},
        {"lease_max_seconds": 0},
        {"history_limit": 10},
    ],
)
def test_a_policy_out_of_bounds_is_refused(fields):
    with pytest.raises(ValidationError):
        BudgetPolicy(**fields)
