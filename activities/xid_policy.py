"""Step 1, classify the fault: XID to fault class, from the policy table (configuration)."""

from __future__ import annotations

import csv
from pathlib import Path

from temporalio import activity

from contracts.models import FaultClass, FaultClassification


class XidPolicyTable:
    def __init__(self, path: Path):
        self.path = path
        rows = csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#"))
        self._entries: dict[int, dict[str, str]] = {}
        for number, row in enumerate(rows, start=2):
            try:
                xid = int(row["xid"])
                FaultClass(row["fault_class"])
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}: row {number} is not 'xid,fault_class,...': {e}") from e
            self._entries[xid] = row

    def classify(self, xid: int) -> FaultClassification:
        row = self._entries.get(xid)
        if row is None:
            return FaultClassification(
                xid=xid, fault_class=FaultClass.UNKNOWN, description="not in the XID policy table",
                policy_source=str(self.path),
            )
        return FaultClassification(
            xid=xid,
            fault_class=FaultClass(row["fault_class"]),
            mnemonic=row.get("mnemonic", ""),
            description=row.get("description", ""),
            catalogue_action=row.get("catalogue_action", ""),
            policy_source=str(self.path),
        )


class ClassifyActivities:
    def __init__(self, table: XidPolicyTable):
        self._table = table

    @activity.defn
    async def classify_fault(self, xid: int) -> FaultClassification:
        return self._table.classify(xid)
