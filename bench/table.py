"""The benchmarks' common output: rows with their baseline, ratio and goal, the table, the machine.

Every figure is a median over the runs of one benchmark, printed next to its baseline measured in
the same run; ratio = value / baseline, whatever the direction of "better" (a goal of "20x faster"
reads ratio <= 0.05).
"""

from __future__ import annotations

import operator
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

from bench.services import BIN

# A bound compares the row's value (or its ratio) with a limit, or with the row's own baseline.
_COMPARE = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}
_SYMBOL = {"<=": "≤", ">=": "≥", "==": "="}


@dataclass(frozen=True)
class Bound:
    subject: str  # "value" or "ratio"
    op: str  # "<=", ">=", "=="
    limit: float | str  # a number, or "baseline"

    def holds(self, value: float, baseline: float | None, ratio: float | None) -> bool | None:
        """None when the bound cannot be judged (no baseline to compare with)."""
        limit = baseline if self.limit == "baseline" else self.limit
        subject = value if self.subject == "value" else ratio
        if subject is None or limit is None:
            return None
        return _COMPARE[self.op](subject, limit)

    def text(self, unit: str) -> str:
        if self.limit == "baseline":
            return f"{_SYMBOL[self.op]} baseline"
        if self.subject == "ratio":
            return f"{_SYMBOL[self.op]} {_number(float(self.limit))}x baseline"
        return f"{_SYMBOL[self.op]} {_number(float(self.limit))}{_unit_suffix(unit)}"


@dataclass(frozen=True)
class Goal:
    bounds: tuple[Bound, ...]
    note: str = ""  # says what the bounds mean to a reader, e.g. "20x faster"

    def text(self, unit: str) -> str:
        words = " and ".join(b.text(unit) for b in self.bounds)
        return f"{words} ({self.note})" if self.note else words

    def met(self, value: float, baseline: float | None, ratio: float | None) -> bool | None:
        verdicts = [b.holds(value, baseline, ratio) for b in self.bounds]
        if any(v is False for v in verdicts):
            return False
        return None if any(v is None for v in verdicts) else True


def goal(*bounds: str, note: str = "") -> Goal:
    """goal("value <= 0.5", "ratio <= 1.5"); the limit may be "baseline"."""
    parsed = []
    for text in bounds:
        subject, op, limit = text.split()
        parsed.append(Bound(subject, op, limit if limit == "baseline" else float(limit)))
    return Goal(tuple(parsed), note)


@dataclass
class Row:
    name: str
    value: float
    unit: str
    baseline: float | None
    ratio: float | None
    goal: str
    met: bool | None

    def as_json(self) -> dict:
        return asdict(self)


def row(
    name: str, value: float, unit: str, baseline: float | None = None, target: Goal | None = None, digits: int = 3
) -> Row:
    ratio = None if baseline in (None, 0) else round(value / baseline, 3)
    return Row(
        name=name,
        value=round(value, digits),
        unit=unit,
        baseline=None if baseline is None else round(baseline, digits),
        ratio=ratio,
        goal=target.text(unit) if target else "",
        met=target.met(value, baseline, ratio) if target else None,
    )


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render(rows: list[Row]) -> str:
    headers = ("benchmark", "value", "baseline", "ratio", "goal", "met")
    cells = [
        (
            r.name,
            _with_unit(r.value, r.unit),
            _with_unit(r.baseline, r.unit),
            "-" if r.ratio is None else f"{_number(r.ratio)}x",
            r.goal or "-",
            {True: "yes", False: "NO", None: "-"}[r.met],
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    right = (False, True, True, True, False, False)

    def line(values) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def _number(x: float) -> str:
    if x == int(x) and abs(x) >= 1:
        return f"{int(x):,}"
    return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _unit_suffix(unit: str) -> str:
    return "" if unit in ("", "x") else ("" if unit.startswith("/") else " ") + unit


def _with_unit(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{_number(x)}{_unit_suffix(unit)}"


def machine() -> dict:
    """The facts a figure depends on: the machine, its load, and the versions that ran."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    temporal = subprocess.run([str(BIN / "temporal"), "--version"], capture_output=True, text=True).stdout.strip()
    slurmctld = shutil.which("slurmctld") or shutil.which("slurmctld", path="/usr/sbin")
    slurm = subprocess.run([slurmctld, "-V"], capture_output=True, text=True).stdout.strip() if slurmctld else ""
    load = os.getloadavg()
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu": model,
        "load_average_1m": round(load[0], 2),
        "load_average_5m": round(load[1], 2),
        "python": platform.python_version(),
        "temporal_cli": temporal,
        "slurm": slurm or "not installed",
        **{p: version(p) for p in ("temporalio", "starlette", "uvicorn", "pydantic")},
    }
