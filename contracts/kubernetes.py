"""Contracts of the Kubernetes activities (Slurm on Kubernetes with Slinky's slurm-operator).

A Slurm node there is a slurmd pod of a NodeSet; the Kubernetes Node under it is what is fenced
and replaced. Names: `node` is always a Kubernetes Node, `slurm_node` the Slurm node name (the
slurmd pod's hostname), which differs from the Node's in the NodeSet's StatefulSet mode.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, get_args

from pydantic import AwareDatetime, Field

from contracts.models import ActionContext, ActionRecord, Contract, KubeName, NodeName, SlurmdPod

TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]

NODESET_GROUP = "slinky.slurm.net"
NODESET_PLURAL = "nodesets"
# The versions of slinky.slurm.net whose NodeSets this project reads and writes, the preferred
# first: slurm-operator 1.x serves only v1beta1, the 0.x releases v1alpha1.
NodeSetVersion = Literal["v1beta1", "v1alpha1"]
# The reason every slurmd pod's preStop hook sets, with DOWN, when the pod terminates (Slinky
# slurm-operator from v1.2.0, internal/builder/workerbuilder/worker_app.go): after an eviction the
# Slurm node reads as the operator's, whoever had drained it.
SLURMD_PRE_STOP_REASON = "slurm-operator: Pod is terminating"
NODESET_VERSIONS: tuple[NodeSetVersion, ...] = get_args(NodeSetVersion)
# How a NodeSet scales its slurmd pods (spec.scalingMode, default StatefulSet; api/v1beta1/nodeset_types.go):
# StatefulSet keeps `replicas` pods, each with its own identity (pod name, hostname, Slurm node),
# recreated under that identity on whichever Node can take it; DaemonSet runs one pod on each
# matching Node, its Slurm node named after the Node, and ignores `replicas`.
ScalingMode = Literal["StatefulSet", "DaemonSet"]


class NodeSetRef(Contract):
    namespace: KubeName
    name: KubeName
    # None: the first of NODESET_VERSIONS the cluster serves
    version: NodeSetVersion | None = None


# --- fencing ----------------------------------------------------------------------------------


class Taint(Contract):
    key: str
    value: str = ""
    effect: TaintEffect


class NodeCondition(Contract):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: datetime | None = None


class FencePriorState(Contract):
    """What the Node had, of what a fence changes, before this incident fenced it.

    Kept on the Node itself (an annotation written in the same update as the cordon and the
    taint), so that a retried fence never takes its own fence for the state before it; unfence
    restores exactly this and leaves everything else on the Node as it finds it."""

    incident_id: str
    owner: str
    fenced_at: datetime = Field(description="when this incident first fenced the Node (the worker's clock)")
    unschedulable: bool
    taint: Taint | None = Field(description="the taint with the fence's key and effect, if the Node had one")
    condition: NodeCondition | None = Field(description="the fence's condition type, if the Node had it")
    cordon_reason: str | None = Field(
        description="Slinky's nodeset.slinky.slurm.net/node-cordon-reason annotation, if the Node had it"
    )


class K8sNodeRequest(Contract):
    node: KubeName
    ctx: ActionContext
    # the unfence: the Slurm node whose repair it follows (None: unfence whatever runs there now)
    slurm_node: NodeName | None = None


class K8sFenceResult(Contract):
    node: KubeName
    prior: FencePriorState | None = Field(description="None when the Node was left as found")
    changed: bool = Field(description="this call wrote something (false on a retry of a complete fence)")
    cordoned_by_other: bool = Field(
        description="the Node was cordoned before this incident: left cordoned by its owner, never uncordoned by us"
    )
    fenced_by_other_incident: str | None = Field(
        None, description="the Node carries another incident's fence: left exactly as found"
    )
    actions: list[ActionRecord]


class K8sUnfenceResult(Contract):
    node: KubeName
    changed: bool
    restored: FencePriorState | None = Field(description="what was restored; None when there was nothing of ours")
    detail: str
    actions: list[ActionRecord]


# --- the slurmd pod -----------------------------------------------------------------------------


class SlurmdPodRequest(Contract):
    slurm_node: NodeName


class EvictRequest(Contract):
    pod: SlurmdPod = Field(description="as located; only this pod (its uid) is evicted, never a successor")
    ctx: ActionContext


class EvictResult(Contract):
    pod: SlurmdPod
    evicted: bool = Field(description="the eviction was accepted, by this call or an earlier attempt")
    terminated: bool = Field(description="the pod is gone; false when it was still Terminating at the deadline")
    pdb_refusals: int = Field(description="429s from a PodDisruptionBudget before the eviction was accepted")
    slurm_state: str = Field(description="the Slurm node as read right before the eviction")
    detail: str
    actions: list[ActionRecord]


# --- replacement ---------------------------------------------------------------------------------


class K8sReplacementRequest(Contract):
    failed_node: KubeName
    slurm_node: NodeName
    ctx: ActionContext


class K8sReplacementResult(Contract):
    provider: str
    accepted: bool = Field(description="the provider took the request; false: no replacement will come")
    node: KubeName | None = Field(
        description="the Node that replaces the failed one, when the provider names it (the http provider); "
        "otherwise wait_for_k8s_node finds it"
    )
    detail: str
    actions: list[ActionRecord] = Field(default_factory=list)


class K8sSpareWaitRequest(Contract):
    failed_node: KubeName
    since: AwareDatetime = Field(
        description="a slurmd pod created at or after this (to the second) is new; pass the fence's fenced_at"
    )
    node: KubeName | None = Field(None, description="wait for this Node only (a provider named it)")
    deadline_seconds: float = Field(gt=0)


class K8sSpareResult(Contract):
    node: KubeName | None
    slurm_node: NodeName | None
    healthy: bool
    in_service_at: datetime | None = None
    detail: str
