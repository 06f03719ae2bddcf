"""Step 1, classify the fault: XID to fault class, from the policy table (configuration); and
how many application XIDs a GPU had recently, from the incidents Temporal keeps."""

from __future__ import annotations

import csv
import re
from datetime import timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import Client

from contracts import search_attributes as sa
from contracts.models import ApplicationXidCountRequest, FaultClass, FaultClassification, NodeFailureAlert, utc_now

# XID 154 carries the driver's own recommendation, e.g. "GPU recovery action changed from 0x0
# (None) to 0x2 (Node Reboot Required)"; NVIDIA's catalogue says to follow it.
RECOVERY_ACTION_XID = 154
RECOMMENDED_ACTIONS: dict[str, FaultClass] = {
    "none": FaultClass.APPLICATION,  # nothing to do on the node
    "drain p2p": FaultClass.DEGRADING,  # still usable: checkpoint, then move the work
    "drain and reset": FaultClass.DEGRADING,
    "gpu reset required": FaultClass.FATAL,  # unusable until reset
    "node reboot required": FaultClass.FATAL,
}
_RECOMMENDED = re.compile(r"\((" + "|".join(map(re.escape, RECOMMENDED_ACTIONS)) + r")\)", re.IGNORECASE)


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

    def classify(self, xid: int, message: str = "") -> FaultClassification:
        row = self._entries.get(xid)
        if row is None:
            return FaultClassification(
                xid=xid,
                fault_class=FaultClass.UNKNOWN,
                description="not in the XID policy table",
                policy_source=str(self.path),
            )
        classification = FaultClassification(
            xid=xid,
            fault_class=FaultClass(row["fault_class"]),
            mnemonic=row.get("mnemonic", ""),
            description=row.get("description", ""),
            catalogue_action=row.get("catalogue_action", ""),
            policy_source=str(self.path),
        )
        if xid == RECOVERY_ACTION_XID:
            # The last action named is the one the driver changed to; none named: unknown, escalate.
            named = _RECOMMENDED.findall(message)
            if named:
                classification.fault_class = RECOMMENDED_ACTIONS[named[-1].lower()]
                classification.policy_source = f"the driver's recommended action: {named[-1]}"
        return classification

    def xids_of(self, fault_class: FaultClass) -> list[int]:
        return sorted(x for x, row in self._entries.items() if row["fault_class"] == fault_class.value)


class ClassifyActivities:
    def __init__(self, table: XidPolicyTable, temporal: Client):
        self._table = table
        self._temporal = temporal

    @activity.defn
    async def classify_fault(self, alert: NodeFailureAlert) -> FaultClassification:
        return self._table.classify(alert.xid, alert.message)

    @activity.defn
    async def count_application_incidents(self, req: ApplicationXidCountRequest) -> int:
        """Earlier incidents for application XIDs on this node's GPU within the window, from
        Temporal's visibility (so the count survives restarts and needs no store of its own)."""
        since = (utc_now() - timedelta(seconds=req.window_seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
        xids = ", ".join(map(str, self._table.xids_of(FaultClass.APPLICATION)))
        query = (
            f"WorkflowType = 'NodeRecoveryWorkflow' AND {sa.NODE.name} = '{req.node}' "
            f"AND {sa.XID.name} IN ({xids}) AND StartTime > '{since}' AND RunId != '{req.this_run_id}'"
        )
        if req.gpu is not None:
            query += f" AND {sa.GPU.name} = '{req.gpu}'"
        return (await self._temporal.count_workflows(query)).count
