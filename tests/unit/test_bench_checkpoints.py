"""The checkpoints benchmark measures what it says: the store verifies the newest checkpoint once per
store (the rest from its verdicts), the baseline every checkpoint on every poll."""

from __future__ import annotations

import pytest

from bench import checkpoints


async def test_the_store_verifies_once_and_each_row_has_its_baseline():
    result = await checkpoints.run(runs=2, quick=True)
    assert result.verifications == 2 and len(result.steady) == 10
    first, later = result.rows()
    # One baseline, rounded to 1 and 2 decimals: half a unit of the coarser apart at most (30.55 and
    # 30.6 failed a plain abs=0.05 by the float error of the subtraction).
    assert first.baseline is not None and later.baseline == pytest.approx(first.baseline, abs=0.05 + 1e-9)
    assert first.value < first.baseline and later.value < first.baseline
