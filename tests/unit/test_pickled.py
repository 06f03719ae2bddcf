"""A checkpoint's pickle is read without running any of it: what it names becomes an inert stub."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.checkpoints import pickled


class Harmful:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_a_command_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    loaded = pickled.load(pickle.dumps({"storage_data": Harmful(marker)}))
    assert not marker.exists()
    stub = loaded["storage_data"]
    assert isinstance(stub, pickled.Stub) and stub.stub_name.endswith(".system")
    assert stub.args == (f"touch {marker}",)


@dataclass
class Info:
    relative_path: str
    offset: int


def test_a_dataclass_reads_back_as_its_fields_and_a_cut_pickle_is_a_value_error():
    data = pickle.dumps([Info("__0_0.distcp", 16)])
    [info] = pickled.load(data)
    assert (info.field("relative_path"), info.field("offset")) == ("__0_0.distcp", 16)
    with pytest.raises(ValueError, match="not a readable pickle"):
        pickled.load(data[: len(data) // 2])
