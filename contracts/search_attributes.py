"""Custom search attributes of an incident, so that operators can filter runs in the Temporal Web
UI and `temporal workflow list --query` (e.g. RecoveryNode = "gpu-3" AND RecoveryOutcome = "recovered").

The worker registers them at start-up; on a real cluster an operator may create them instead:
    temporal operator search-attribute create --name RecoveryNode --type Keyword (and so on)
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

NODE = SearchAttributeKey.for_keyword("RecoveryNode")
XID = SearchAttributeKey.for_int("RecoveryXid")
PHASE = SearchAttributeKey.for_keyword("RecoveryPhase")
OUTCOME = SearchAttributeKey.for_keyword("RecoveryOutcome")
JOB_IDS = SearchAttributeKey.for_keyword_list("RecoveryJobIds")
# Nodes that shared a job with the failed node when it failed: alerts that follow from this
# failure on those peers (NVLink, NCCL timeouts) join this incident.
PEER_NODES = SearchAttributeKey.for_keyword_list("RecoveryPeerNodes")
# The GPU the first alert named: application XIDs are counted per GPU over a window.
GPU = SearchAttributeKey.for_keyword("RecoveryGpu")

ALL = (NODE, XID, PHASE, OUTCOME, JOB_IDS, PEER_NODES, GPU)


def outcome_label(outcome: str) -> str:
    """The outcome's kind, short enough to filter on ("recovered", "failed in drain", ...): the
    value of OUTCOME, and the outcome attribute of the incident metrics."""
    return outcome.split(":", 1)[0]
