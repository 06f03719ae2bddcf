"""Turn Slurm's JSON (squeue/sinfo --json and slurmrestd, 22.05 and newer) into contracts."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import hostlist

from contracts.models import FINISHED_JOB_STATES, SlurmJob, SlurmNode

# The fields read below, for the contract tests against each slurmrestd's OpenAPI document.
# (22.05 keeps node flags in `state_flags`, newer versions in the `state` list.)
NODE_FIELDS = ("name", "state", "reason", "comment", "partitions")
JOB_FIELDS = (
    "job_id",
    "job_state",
    "nodes",
    "restart_cnt",
    "requeue",
    "comment",
    "priority",
    "state_reason",
    "name",
    "excluded_nodes",
    "required_nodes",
    "flags",
    "end_time",
)

# Flags that newer Slurm reports inside the state list instead of a separate field.
_BASE_NODE_STATES = {
    "IDLE",
    "MIXED",
    "ALLOCATED",
    "DOWN",
    "ERROR",
    "FUTURE",
    "UNKNOWN",
    "COMPLETING",
}


def expand_nodes(value: str | list[str] | None) -> list[str]:
    if not value:
        return []
    parts = value if isinstance(value, list) else [value]
    return [str(n) for part in parts for n in hostlist.expand_hostlist(part)]


def node_from_json(raw: dict[str, Any]) -> SlurmNode:
    state = raw.get("state")
    flags = [str(f).upper() for f in raw.get("state_flags") or []]
    if isinstance(state, list):  # 23.02+: ["IDLE", "DRAIN"]
        names = [str(s).upper() for s in state]
        base = next((s for s in names if s in _BASE_NODE_STATES), names[0] if names else "UNKNOWN")
        flags += [s for s in names if s != base]
        state = base
    return SlurmNode(
        name=raw["name"],
        state=str(state or "unknown").lower(),
        flags=sorted(set(flags)),
        reason=raw.get("reason") or "",
        comment=raw.get("comment") or "",
        partitions=[str(p) for p in raw.get("partitions") or []],
    )


def _number(value: Any) -> int:
    """22.05 gives plain integers; 23.02+ wraps them as {"set": bool, "number": int}."""
    if isinstance(value, dict):
        return int(value.get("number", 0)) if value.get("set", True) else 0
    return int(value or 0)


def _time(value: Any) -> datetime | None:
    """An epoch time as Slurm gives it (0, or unset, for none yet)."""
    seconds = _number(value)
    return datetime.fromtimestamp(seconds, tz=timezone.utc) if seconds > 0 else None


def job_from_json(raw: dict[str, Any]) -> SlurmJob:
    state = raw.get("job_state")
    if isinstance(state, list):  # 23.02+: ["PENDING", "REQUEUED"]
        # A requeued job is ["PENDING", "COMPLETING"] while its processes still exit (22.05 says
        # COMPLETING): until they are gone, it may still write a checkpoint.
        state = "COMPLETING" if "COMPLETING" in state else state[0] if state else "UNKNOWN"
    return SlurmJob(
        job_id=_number(raw["job_id"]),
        name=raw.get("name") or "",
        state=str(state).upper(),
        state_reason=raw.get("state_reason") or "",
        nodes=expand_nodes(raw.get("nodes")),
        restart_count=_number(raw.get("restart_cnt")),
        requeue=bool(raw.get("requeue", True)),
        comment=raw.get("comment") or "",
        excluded_nodes=expand_nodes(raw.get("excluded_nodes")),
        required_nodes=expand_nodes(raw.get("required_nodes")),
        priority=_number(raw.get("priority")),
        # 25.11+: submitted --requeue=expedite (what Slurm does with it depends on the cluster's
        # SlurmctldParameters=enable_expedited_requeue)
        expedited_requeue="EXPEDITED_REQUEUE" in (raw.get("flags") or []),
        # a pending or running job's end_time is its expected end: read it only once it ended
        end_time=_time(raw.get("end_time")) if str(state).upper() in FINISHED_JOB_STATES else None,
    )
