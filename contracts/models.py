"""Pydantic models: the contracts between alert sources, workflows, activities and backends.

Every value that crosses a Temporal boundary (workflow input, signal, query, activity argument or
result) is one of these, so a malformed value fails at the edge with a clear error instead of
deep inside a recovery.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Slurm node names as the controller accepts them: one host name, no host list syntax
# ("gpu-[1-4]", commas) and nothing a shell or scontrol's key=value parser could misread.
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _check_node_name(name: str) -> str:
    if not _NODE_NAME.fullmatch(name):
        raise ValueError(
            f"invalid node name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no host lists)"
        )
    return name


NodeName = Annotated[str, AfterValidator(_check_node_name)]
# Slurm job ids are positive 32-bit integers; array and het-job suffixes are not accepted.
JobId = Annotated[int, Field(gt=0, lt=2**32)]
Xid = Annotated[int, Field(ge=1, le=999)]
Actor = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\n\r]+$")]
# A GPU as nvidia-smi and DCGM name it: its index on the node, its UUID (a MIG instance's too), its
# PCI address (domain:bus:device.function, lower case, as canonical_pci_address writes it).
MAX_GPU_INDEX = 63
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
GpuIndex = Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]


def _assume_utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


# A time a training job wrote: without a zone it is taken as UTC (compared with the controller's
# aware times, a naive one would fail the comparison, and a workflow task with it)
JobTime = Annotated[datetime, AfterValidator(_assume_utc)]
GpuUuid = Annotated[str, Field(pattern=GPU_UUID.pattern)]
PciAddress = Annotated[str, Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")]
_PCI_ADDRESS = re.compile(r"^(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?$")


def canonical_pci_address(text: str) -> str | None:
    """'PCI:0000:3B:00' (the kernel's), '00000000:3b:00.0' (DCGM's) -> '0000:3b:00.0'; None if not one.
    One spelling per GPU, so that its alerts from every source name it alike."""
    match = _PCI_ADDRESS.match(text)
    if match is None or int(match.group(1), 16) > 0xFFFF:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function or 0}"


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


# --- fault policy ---------------------------------------------------------------------------


class FaultClass(StrEnum):
    FATAL = "fatal"  # the GPU is gone: fence at once, no emergency checkpoint wait
    DEGRADING = "degrading"  # the GPU still works: let jobs checkpoint, then move them
    APPLICATION = "application"  # the job's own fault: no node action
    UNKNOWN = "unknown"  # drain, keep jobs running, escalate to a person


class FaultClassification(Contract):
    xid: Xid
    fault_class: FaultClass
    mnemonic: str = ""
    description: str = ""
    catalogue_action: str = ""
    policy_source: str = Field(description="the policy table the class came from")


# --- alerts and workflow input ----------------------------------------------------------------

MAX_DIGEST_SAMPLE = 20  # alerts (and sources) in one AlertDigest


class NodeFailureAlert(Contract):
    """One report that a node's GPU failed, from any source (CLI, drill, hooks)."""

    node: NodeName
    xid: Xid
    source: Annotated[str, Field(min_length=1, max_length=64)]
    actor: Actor = Field(description="who asked: a person, a hook or a policy")
    reason: Annotated[str, Field(min_length=1, max_length=500)] = "GPU fault reported"
    observed_at: datetime = Field(default_factory=utc_now)
    message: Annotated[str, Field(max_length=2000)] = ""
    gpu: Annotated[str, Field(pattern=r"^[A-Za-z0-9:._-]{1,64}$")] | None = Field(
        None,
        description="which GPU: index, UUID or PCI bus id as the source names it; when unset, the best "
        "of gpu_uuid, pci_address and gpu_index (application XIDs are counted per this value)",
    )
    gpu_index: GpuIndex | None = None
    gpu_uuid: GpuUuid | None = None
    pci_address: PciAddress | None = None
    observed_on: NodeName | None = Field(
        None,
        description="where the symptom was seen, when not on `node`: a peer of the failed node "
        "whose alert (NVLink, NCCL timeout) was correlated to this node's incident",
    )

    @model_validator(mode="after")
    def _gpu_from_its_identifiers(self) -> NodeFailureAlert:
        # The UUID first: it names one GPU for its life, where an index or a PCI address can name
        # another GPU after a reboot or a board swap.
        if self.gpu is None:
            index = None if self.gpu_index is None else str(self.gpu_index)
            self.gpu = self.gpu_uuid or self.pci_address or index
        return self


class AlertDigest(Contract):
    """Alerts for a running incident beyond what the hook hands over in full: a sample (the latest
    of each source) and how many more each source sent. A flood costs the incident's history one
    small digest per interval, not one alert body per alert (docs/alert-hooks.md, "Floods")."""

    alerts: Annotated[list[NodeFailureAlert], Field(max_length=MAX_DIGEST_SAMPLE)] = Field(default_factory=list)
    omitted: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="per source: alerts counted, not sent", max_length=MAX_DIGEST_SAMPLE
    )


# Destructive steps an operator may be asked to approve first: requeueing the jobs (their
# processes are killed) and bringing in replacement capacity.
ApprovalGate = Literal["requeue", "replacement"]  # the gates a policy can require
# Where an incident may wait for an operator: a policy gate, over the fleet disruption budget, or
# held by the fence circuit breaker.
Gate = Literal["requeue", "replacement", "budget", "breaker"]


class PinnedJobs(StrEnum):
    """A job pinned to its nodes (`sbatch -w`) that lost one: Slurm would keep it PENDING
    (BadConstraints) for good once it is kept off the failed node."""

    UNPIN = "unpin"  # requeue it with the failed nodes taken out of its pin (ReqNodeList), the rest kept
    LEAVE = "leave"  # leave it as found and say why: it runs again only on its pinned nodes


class RecoveryPolicy(Contract):
    """How an incident behaves; set by the starter from configuration, fixed for the run."""

    owner: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] = "recovery"
    degrading_grace_seconds: float = Field(120.0, ge=0, le=24 * 3600)
    checkpoint_poll_seconds: float = Field(1.0, gt=0, le=60)
    spare_nodes: list[NodeName] = Field(default_factory=list)
    spare_wait_seconds: float = Field(300.0, gt=0)
    spare_for_idle_node: bool = Field(
        False,
        description="claim a hot spare also when no job was on the failed node (capacity for the queue); "
        "off: the spares stay on standby for an incident with a job to resume at full size",
    )
    verify_deadline_seconds: float = Field(600.0, gt=0)
    pinned_jobs: PinnedJobs = Field(
        PinnedJobs.UNPIN,
        description="a job pinned to the failed node: requeued without that node in its pin "
        "(unpin), or left as found (leave)",
    )
    dry_run: bool = Field(
        False,
        description="observe mode: run every decision, record each action it "
        "would take with its exact command, execute none",
    )
    application_xid_threshold: int = Field(
        3,
        ge=1,
        description="application XIDs (13, 31, 43, ...) on one GPU within the window before the node is "
        "drained and escalated; fewer: no node action",
    )
    application_xid_window_seconds: float = Field(24 * 3600.0, gt=0)
    kubernetes: bool = Field(
        False,
        description="Slurm on Kubernetes: fence the Node, evict the slurmd pod "
        "after the drain, replace through the configured Kubernetes provider",
    )
    repair_poll_seconds: float = Field(
        300.0, gt=0, description="after a recovery, how often the failed node is checked for repair"
    )
    repair_wait_seconds: float = Field(7 * 24 * 3600.0, gt=0, description="how long to wait for a repair")
    approval_required: list[ApprovalGate] = Field(
        default_factory=list, description="destructive steps that wait for an operator's approve/deny"
    )
    approval_min_job_nodes: int = Field(
        1, ge=1, description="the requeue gate asks only when a job on the node spans at least this many nodes"
    )
    approval_timeout_seconds: float = Field(3600.0, gt=0)
    approval_timeout_action: Literal["deny", "approve"] = Field(
        "deny", description="what an unanswered gate does; deny is the safe default: stay drained, kill nothing"
    )
    fleet_budget: bool = Field(
        True,
        description="take a lease from the fleet disruption budget before the first destructive step "
        "(workflows/fleet_budget.py); off only for a worker that runs no budget",
    )
    fence_hold_seconds: float = Field(
        3600.0,
        gt=0,
        description="how long an incident held by a tripped fence circuit breaker waits for a reset "
        "or an operator's answer; then it ends, nothing drained (a new alert opens a new incident)",
    )
    notify: bool = Field(
        False,
        description="send webhook notifications (incident opened, approval needed, "
        "failed, recovered); on when the worker has RECOVERY_NOTIFY_WEBHOOK_URL",
    )
    search_attributes: bool = Field(
        True,
        description="keep the incident's search attributes (contracts/search_attributes.py) current; "
        "off only where they cannot be registered (e.g. Temporal's time-skipping test server)",
    )

    def narrowed_by(self, requested: RecoveryPolicy) -> RecoveryPolicy:
        """This (the worker's) policy, made only safer by what a starter asked for: observe mode, more
        approval gates, pinned jobs left as found. Nothing a starter sends takes a gate away, adds a
        spare, shortens a wait or changes a job the worker would leave."""
        gates = self.approval_required + [g for g in requested.approval_required if g not in self.approval_required]
        pinned = PinnedJobs.LEAVE if PinnedJobs.LEAVE in (self.pinned_jobs, requested.pinned_jobs) else self.pinned_jobs
        return self.model_copy(
            update={"dry_run": self.dry_run or requested.dry_run, "approval_required": gates, "pinned_jobs": pinned}
        )


class ApprovalRequest(Contract):
    gate: Gate
    question: str
    asked_at: datetime
    deadline_at: datetime | None = Field(
        None,
        description="when the policy's default answer applies; none at the budget gate, which waits "
        "until the budget frees up or an operator answers",
    )


class OperatorSignature(Contract):
    """An operator's Ed25519 signature over a decision and where it applies (contracts/operators.py)."""

    signed_at: datetime
    value: Annotated[str, Field(min_length=1, max_length=200, description="base64 of the 64-byte signature")]


class OperatorDecision(Contract):
    """An operator's answer to an incident (workflow updates `approve`, `deny`, `abort`), signed
    with the operator's key (`recovery approve` signs it): the worker verifies it before it counts."""

    actor: Actor
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    signature: OperatorSignature | None = None


class ApplicationXidCountRequest(Contract):
    """How many incidents for application XIDs this node's GPU had within the window."""

    node: NodeName
    gpu: str | None
    window_seconds: float
    this_run_id: str = Field(description="the asking incident, not counted")


class RecoveryRequest(Contract):
    node: NodeName
    policy: RecoveryPolicy = Field(default_factory=RecoveryPolicy)


# --- Slurm state ------------------------------------------------------------------------------


class SlurmNode(Contract):
    name: NodeName
    state: str = Field(description="base state in lower case: idle, mixed, allocated, down, ...")
    flags: list[str] = Field(default_factory=list, description="upper case: DRAIN, NOT_RESPONDING, ...")
    reason: str = ""
    comment: str = ""
    partitions: list[str] = Field(default_factory=list)

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state in ("drained", "draining")

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags

    @property
    def in_service(self) -> bool:
        return (
            self.state in ("idle", "mixed", "allocated")
            and not self.drained
            and self.responding
            and not {"FAIL", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED"} & set(self.flags)
        )


# Job states Slurm reports once a job is over.
FINISHED_JOB_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"})
# How a job the lost GPU killed ends: its tasks crashed (a CUDA or NCCL error) or Slurm found its node dead.
DIED_OF_THE_FAULT = frozenset({"FAILED", "NODE_FAIL"})
# Job states in which a job holds its nodes (running, or completing its signal handling).
HOLDS_ITS_NODES = frozenset({"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING"})


class SlurmJob(Contract):
    job_id: JobId
    name: str = ""
    state: str = Field(description="upper case: RUNNING, PENDING, COMPLETING, ...")
    state_reason: str = ""
    nodes: list[str] = Field(default_factory=list)
    restart_count: int = 0
    requeue: bool = True
    comment: str = ""
    excluded_nodes: list[str] = Field(default_factory=list)
    required_nodes: list[str] = Field(default_factory=list, description="the nodes it is pinned to (ReqNodeList)")
    priority: int = 0
    expedited_requeue: bool = Field(
        False,
        description="submitted --requeue=expedite (Slurm 25.11+): with enable_expedited_requeue, Slurm requeues it "
        "itself when its node fails, and any requeue restarts it at once, without the requeue delay",
    )
    end_time: datetime | None = Field(None, description="when it ended; None while it has not")

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and (self.priority == 0 or "held" in self.state_reason.lower())

    @property
    def checkpoint_dir(self) -> str | None:
        """The job's checkpoint directory, declared in its comment as ``checkpoint_dir=PATH``."""
        return self._comment_value("checkpoint_dir")

    @property
    def checkpoint_format(self) -> CheckpointFormat | None:
        """How the job writes its checkpoints, declared in its comment as ``checkpoint_format=NAME``;
        None (or a name not known) leaves the controller to detect it from the directory."""
        value = self._comment_value("checkpoint_format")
        known = {f.value for f in CheckpointFormat}
        return CheckpointFormat(value) if value is not None and value in known else None

    def _comment_value(self, wanted: str) -> str | None:
        for part in self.comment.split(";"):
            key, _, value = part.strip().partition("=")
            if key == wanted and value:
                return value
        return None


SlurmPath = Literal["cli", "rest"]


# --- checkpoints and progress (read from the job's checkpoint directory) ----------------------


class CheckpointFormat(StrEnum):
    """The checkpoint layouts the controller can read (backends/checkpoints/, one adapter each)."""

    REFERENCE = "reference"  # trainer.checkpoint: step-NNNNNNNNN/ with manifest.json written last
    DCP = "dcp"  # torch.distributed.checkpoint: a directory of shards, .metadata written last
    HF_TRAINER = "hf_trainer"  # Hugging Face Trainer: checkpoint-<step>/ with trainer_state.json written last
    LIGHTNING = "lightning"  # Lightning: *.ckpt files, each written whole and renamed into place
    MEGATRON = "megatron"  # Megatron/NeMo: iter_NNNNNNN/ and latest_checkpointed_iteration.txt written last


class CheckpointRef(Contract):
    checkpoint_id: str = Field(description="the checkpoint's directory or file name in the job's checkpoint_dir")
    step: int
    train_seconds: float | None = Field(None, description="training time at the checkpoint, where the format keeps it")
    created_at: datetime = Field(description="when it was written: its manifest's time, or its last file's")
    checkpoint_format: CheckpointFormat = CheckpointFormat.REFERENCE


# A job writes its own resume record, and what it says goes into the incident's history: kept to a
# bound (cut, not refused, so that an oversized record still says where the job resumed from)
MAX_SKIPPED_RECORDED = 20
MAX_SKIP_TEXT = 300


def _cut(text: str) -> str:
    return text if len(text) <= MAX_SKIP_TEXT else text[: MAX_SKIP_TEXT - 1] + "…"


class SkippedCheckpoint(Contract):
    checkpoint_id: Annotated[str, AfterValidator(_cut)]
    why: Annotated[str, AfterValidator(_cut)]


def _newest_skipped(skipped: list[SkippedCheckpoint]) -> list[SkippedCheckpoint]:
    return skipped[:MAX_SKIPPED_RECORDED]


class ResumeRecord(Contract):
    job_id: str
    restart_count: int
    resumed_step: int | None
    checkpoint_id: str | None
    skipped_checkpoints: Annotated[list[SkippedCheckpoint], AfterValidator(_newest_skipped)] = Field(
        default_factory=list, description=f"as the job listed them, the first {MAX_SKIPPED_RECORDED} kept"
    )
    previous_last_step: int | None = None
    previous_train_seconds: float | None = None
    resumed_train_seconds: float = 0.0
    started_at: JobTime = Field(description="when the job went on training: after loading its checkpoint")
    launched_at: JobTime | None = Field(None, description="when the job's process started, before loading")
    host: str = ""


class JobProgress(Contract):
    job_id: str
    restart_count: int
    step: int
    train_seconds: float
    updated_at: JobTime
    state: str
    save_seconds: float | None = Field(None, description="this run's time spent blocked saving checkpoints")


# --- what the workflow asks of activities ----------------------------------------------------


class ActionContext(Contract):
    """Who asks for a side effect and why; every side effect carries one into the audit trail."""

    incident_id: str
    owner: str
    actor: str
    reason: str
    xid: int
    mnemonic: str = ""
    dry_run: bool = Field(False, description="observe mode: describe every write, execute none")

    def slurm_reason(self) -> str:
        """The reason written on Slurm nodes: says whose fence it is, which fault and which incident."""
        what = f"XID {self.xid}" + (f" {self.mnemonic}" if self.mnemonic else "")
        return f"{self.owner}: {what} incident {self.incident_id} by {self.actor}"[:250]


class NodeRequest(Contract):
    node: NodeName
    ctx: ActionContext


class SignalRequest(Contract):
    job_id: JobId
    signal: Literal["USR1", "USR2", "TERM"]
    ctx: ActionContext
    # Where the incident found the job: it is signalled only while it still runs there, in that run.
    node: NodeName | None = None
    restart_count: int | None = Field(None, ge=0)


class CheckpointWaitRequest(Contract):
    job_id: JobId
    checkpoint_dir: str
    checkpoint_format: CheckpointFormat | None = None
    after_step: int | None
    poll_seconds: float


class FindJobsRequest(Contract):
    node: NodeName
    died_since: datetime | None = Field(
        None,
        description="also the requeueable jobs that died on the node (FAILED, NODE_FAIL) from then on: a lost "
        "GPU's crashed rank can end a job before the alert arrives; None: the jobs holding the node only",
    )


class ReadmitRequest(Contract):
    """The failed Slurm node serves again from new hardware under its name (a StatefulSet-mode
    slurmd pod recreated on another Node): the incident's jobs kept off it may use it again."""

    node: NodeName
    job_ids: list[JobId]
    why: Annotated[str, Field(max_length=500)]
    ctx: ActionContext


class RequeueRequest(Contract):
    job: SlurmJob
    failed_node: NodeName
    ctx: ActionContext
    also_failed: list[NodeName] = Field(default_factory=list, description="the job's other failed nodes")
    pinned_jobs: PinnedJobs = PinnedJobs.UNPIN

    @property
    def failed_nodes(self) -> list[str]:
        return sorted({self.failed_node, *self.also_failed})


# Slurm on Kubernetes, as the platform seam carries it (contracts/kubernetes.py has the rest).
# RFC 1123 subdomain: what the API server accepts as a Node, pod or NodeSet name.
_KUBE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _check_kube_name(name: str) -> str:
    if not _KUBE_NAME.fullmatch(name):
        raise ValueError(f"invalid Kubernetes object name {name!r}: lower-case RFC 1123 subdomain")
    return name


KubeName = Annotated[str, AfterValidator(_check_kube_name)]


class SlurmdPod(Contract):
    namespace: KubeName
    name: KubeName
    uid: str
    node: KubeName | None = Field(description="the Kubernetes Node it is bound to (None while unscheduled)")
    slurm_node: NodeName = Field(description="the pod's hostname: the Slurm node name slurmd registers")
    created_at: datetime
    ready: bool
    terminating: bool


# --- the platform seam (backends/platform.py): the node's fence, its release, replacement capacity ---


class FenceHandle(Contract):
    """What the platform's fence learned about the node, handed back to the platform by the
    workflow as it came: the story reads only whether spares wait on standby, and what the return
    to service unfences."""

    platform: str = Field(description="the platform the worker was bound to: slurm or kubernetes")
    slurm_node: NodeName
    fenced_at: datetime = Field(description="when the fence began: replacement capacity is newer")
    spares_on_standby: bool = Field(
        description="replacement capacity waits on standby (hot spares), claimed one spare at a time"
    )
    pod: SlurmdPod | None = Field(None, description="Slurm on Kubernetes: the slurmd pod that is the node")
    unfence_node: KubeName | None = Field(
        None, description="what the return to service unfences besides Slurm: the Kubernetes Node under the pod"
    )


class FenceRequest(Contract):
    node: NodeName
    ctx: ActionContext


class FenceResult(Contract):
    handle: FenceHandle
    detail: str
    actions: list[ActionRecord] = Field(default_factory=list)


class ReleaseRequest(Contract):
    handle: FenceHandle
    ctx: ActionContext


class ReleaseResult(Contract):
    detail: str
    actions: list[ActionRecord] = Field(default_factory=list)


class ReplacementRequest(Contract):
    failed_node: NodeName
    spare_nodes: list[NodeName]
    ctx: ActionContext
    handle: FenceHandle | None = Field(None, description="the platform's fence of the failed node")


class SpareWaitRequest(Contract):
    node: NodeName | None = Field(description="the node brought in; None: the platform finds the new one")
    deadline_seconds: float
    handle: FenceHandle | None = Field(None, description="the platform's fence of the failed node")


class VerifyRequest(Contract):
    snapshot: "JobSnapshot"
    failed_node: NodeName
    requeue: "RequeueResult"
    deadline_seconds: float
    also_failed: list[NodeName] = Field(default_factory=list, description="the job's other failed nodes")
    restart_count: int | None = Field(None, description="the restart count the requeue left; None: the snapshot's + 1")
    readmitted: list[NodeName] = Field(
        default_factory=list,
        description="failed nodes serving again from new hardware under their names (a StatefulSet-mode slurmd "
        "pod recreated on another Node): the job may run there",
    )

    @property
    def expected_restart_count(self) -> int:
        """An incident requeues its job once; a job's recovery (workflows/job_recovery.py) says what it left."""
        return self.restart_count if self.restart_count is not None else self.snapshot.job.restart_count + 1

    @property
    def failed_nodes(self) -> list[str]:
        return sorted({self.failed_node, *self.also_failed})


# --- what activities report back -------------------------------------------------------------


class ActionRecord(Contract):
    """One side effect (or a decision not to act), with who asked and why: the audit trail."""

    at: datetime
    action: str
    target: str
    path: str = Field(description="how it was done: cli, rest, filesystem, none")
    detail: str = ""
    actor: str
    reason: str
    command: str = Field("", description="the exact command or API call (method, path, body)")
    executed: bool = Field(True, description="false in dry-run: the action was only intended")


class Invocation(Contract):
    """How a backend did (or, in dry-run, would do) one write: its path and exact command."""

    path: str
    command: str
    executed: bool = True


class NodeHealth(Contract):
    node: NodeName
    healthy: bool
    detail: str


class ReturnToServiceRequest(Contract):
    node: NodeName
    ctx: ActionContext = Field(description="the incident that fenced the node: only its fence is undone")
    kubernetes_node: str | None = Field(
        None, description="Slurm on Kubernetes: the Node the incident fenced, unfenced once the node is healthy"
    )
    kubernetes_unfenced: bool = False
    fleet_budget: bool = Field(False, description="ask the fleet budget first: a quarantined lemon is not returned")
    lemon: bool | None = Field(
        None,
        description="whether the incident's lease found the node quarantined. Only a lemon is asked about at "
        "every look (to hear of its release): a node becomes one only at a lease request of its own next incident, "
        "which takes the node over from this watcher. None: not known, ask",
    )
    poll_seconds: float = Field(gt=0)
    give_up_at: datetime
    checks: int = 0
    actions: list[ActionRecord] = Field(default_factory=list)


class RepairCheck(Contract):
    """One look at a fenced node: returned to service now, or why not (and whether to look again)."""

    node: NodeName
    returned: bool
    final: bool = Field(description="nothing more to wait for: returned, or no longer ours to return")
    detail: str
    action: ActionRecord | None = None


class ReturnToServiceResult(Contract):
    node: NodeName
    returned: bool
    outcome: str
    checks: int
    actions: list[ActionRecord] = Field(default_factory=list)


class NodeFenceResult(Contract):
    node: NodeName
    before: SlurmNode
    after: SlurmNode
    changed: bool
    owned_by_other: bool = Field(description="the node was already drained with a reason not ours")
    action: ActionRecord


class JobSnapshot(Contract):
    """A job on the failed node, as found before anything was done to it."""

    job: SlurmJob
    checkpoint_dir: str | None
    latest_complete: CheckpointRef | None
    progress: JobProgress | None


class CheckpointWaitResult(Contract):
    job_id: JobId
    new_checkpoint: CheckpointRef | None
    waited_seconds: float


class RequeueResult(Contract):
    job_id: JobId
    requeued_now: bool = Field(description="false when an earlier attempt had already requeued it")
    restart_count: int
    latest_complete_at_stop: CheckpointRef | None = Field(
        None, description="the newest complete checkpoint once every process of the job had exited"
    )
    actions: list[ActionRecord]
    left_pinned_to: list[NodeName] = Field(
        default_factory=list, description="the failed nodes the job is pinned to, where the policy left it"
    )


class ReplacementResult(Contract):
    node: NodeName | None = Field(description="the node brought in, or None when none was available")
    provider: str
    detail: str = ""
    actions: list[ActionRecord] = Field(default_factory=list)
    accepted: bool | None = Field(
        None,
        description="the provider took the request, so capacity will come (named now or found by the wait); "
        "None, as hot spare claims answered before the platform seam: whether a node was brought in",
    )

    @property
    def coming(self) -> bool:
        return self.accepted if self.accepted is not None else self.node is not None


class SpareResult(Contract):
    node: NodeName
    healthy: bool
    in_service_at: datetime | None = None
    detail: str = ""


ResumeConfidence = Literal["confirmed", "inferred"]


class JobVerification(Contract):
    job_id: JobId
    verified: bool
    why_not: list[str] = Field(default_factory=list)
    restart_count_before: int
    restart_count_after: int
    nodes_before: list[str]
    nodes_after: list[str]
    expected_checkpoint: CheckpointRef | None = None
    resume: ResumeRecord | None = None
    previous_resume: ResumeRecord | None = Field(None, description="the record of the run the failure interrupted")
    resumed_at: datetime | None = None
    progress_step_after: int | None = None
    evidence: list[str] = Field(
        default_factory=list,
        description="what the verification of the resume rests on: the job's resume record, its progress "
        "record, checkpoints it wrote after the restart",
    )
    confidence: ResumeConfidence | None = Field(
        None,
        description="confirmed: the job's own resume record names the checkpoint it loaded; inferred: it keeps "
        "none, and the first checkpoint it wrote after the restart shows where it went on from",
    )
    verified_at: datetime | None = Field(
        None,
        description="when the job was back as it should be: the poll that saw it, or, when the first look "
        "of an attempt already found it so (its worker had died meanwhile), the job's own record of its restart",
    )


class PeerIncident(Contract):
    """Another node of the same job that failed, and its incident."""

    node: NodeName
    incident_id: str


class JobJoin(Contract):
    """An incident's part in the recovery of a job that ran on its node (workflows/job_recovery.py)."""

    incident_id: str
    workflow_id: str = Field(
        min_length=1, description="the incident's workflow: told of the requeue and the verification"
    )
    node: NodeName
    snapshot: JobSnapshot
    ctx: ActionContext
    verify_deadline_seconds: float
    pinned_jobs: PinnedJobs = PinnedJobs.UNPIN


class JobRequeued(Contract):
    """The requeue that took the job off a joined incident's node."""

    run_id: str = Field(description="the job recovery's run: its result is the job's verification")
    requeue: RequeueResult
    failed_together: list[PeerIncident]


class JobRecoveryFailure(Contract):
    """The job's requeue failed for good: each joined incident fails as its own requeue would have."""

    job_id: JobId
    error_type: str
    message: str


class JobRecovered(Contract):
    """A job recovery's end: its last requeue and the verification of the restart it led to."""

    requeue: RequeueResult
    verification: JobVerification
    failed_together: list[PeerIncident]


# --- the incident, as the workflow shows and reports it ---------------------------------------


class Phase(Contract):
    name: str
    started_at: datetime
    ended_at: datetime | None = None
    result: str = ""


class DecisionRecord(Contract):
    """An answer to a gate or an abort: by an operator, or by the policy when nobody answered."""

    at: datetime
    kind: Literal["approve", "deny", "abort"]
    gate: str | None = None
    actor: str
    reason: str
    verified_by: str | None = Field(
        None,
        description="the fingerprint of the operator's key whose signature "
        "the worker verified; none for the policy's own answers",
    )


class IncidentStatus(Contract):
    incident_id: str
    node: str
    phase: str
    xid: int | None
    fault_class: FaultClass | None
    alerts: list[NodeFailureAlert] = Field(description="the first and last few alerts of each source")
    alert_counts: dict[str, int] = Field(default_factory=dict, description="alerts absorbed, per source")
    phases: list[Phase]
    actions: list[ActionRecord]
    outcome: str | None = None
    peer_nodes: list[str] = Field(default_factory=list, description="nodes that shared a job with the failed node")
    awaiting_approval: ApprovalRequest | None = None
    decisions: list[DecisionRecord] = Field(default_factory=list)


class Goodput(Contract):
    """NVIDIA Cluster Readiness Engine's goodput over one incident's window, from the start of the
    run the failure interrupted to the job training again:
    (t_w - t_ch - t_rm - t_re - t_save) / (t_w - t_re)."""

    window_start: datetime
    window_end: datetime
    wall_seconds: float = Field(description="t_w: the window's wall time")
    lost_work_seconds: float = Field(description="t_ch: training done after the checkpoint resumed from, lost")
    resume_seconds: float = Field(description="t_rm: the restarted job's start to training again (loading)")
    reschedule_seconds: float = Field(description="t_re: the failure to the restarted job's start")
    checkpoint_save_seconds: float = Field(description="t_save: the interrupted run's time blocked saving")
    goodput: float | None = Field(description="the ratio; None when t_w - t_re is not positive")


class JobReport(Contract):
    job_id: JobId
    restart_count: int
    nodes_before: list[str]
    nodes_after: list[str]
    verified: bool
    why_not: list[str] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list, description="what the verification rests on")
    goodput: Goodput | None = Field(
        None, description="None when a term is unknown: the job keeps no resume records with launch times"
    )
    confidence: ResumeConfidence | None = Field(None, description="confirmed by the job's resume record, or inferred")
    resumed_step: int | None = None
    latest_complete_step: int | None = None
    last_step_before_failure: int | None = None
    lost_steps: int | None = None
    lost_seconds: float | None = None
    lost_seconds_basis: str | None = Field(
        None,
        description="how lost_seconds was found: the job's own record of its training time at the checkpoint "
        "and at the failure, or the lost steps times the job's mean step time (its progress record)",
    )
    skipped_checkpoints: list[SkippedCheckpoint] = Field(default_factory=list)
    time_to_resume_seconds: float | None = None
    failed_together: list[PeerIncident] = Field(
        default_factory=list,
        description="the job's other failed nodes and their incidents: one requeue, one verification for all",
    )


class IncidentAction(StrEnum):
    """What the policy decided for the fault."""

    RECOVER = "recover"
    FENCE_AND_ESCALATE = "fence_and_escalate"
    NONE = "none"


class OutcomeKind(StrEnum):
    """What an incident came to, to filter and count on; the outcome's text says the rest."""

    RECOVERED = "recovered"
    NO_NODE_ACTION = "no_node_action"  # an application XID below its threshold
    NO_REPLACEMENT = "no_replacement"  # the jobs resumed, no capacity came in
    SPARE_UNHEALTHY = "spare_unhealthy"
    FAILED_VERIFICATION = "failed_verification"
    FAILED = "failed"  # a step failed for good ("failed in <phase>: ...")
    ESCALATED = "escalated"  # fenced, left to a person
    DENIED = "denied"  # an operator refused a step
    HELD = "held"  # the fence circuit breaker held it, nothing drained
    ABORTED = "aborted"
    DRY_RUN = "dry_run"


class IncidentReport(Contract):
    incident_id: str
    node: str
    xid: int
    fault_class: FaultClass
    action: IncidentAction = Field(description="what the policy decided: recover, fence_and_escalate, none")
    outcome: str = Field(description="'recovered', or why not")
    outcome_kind: OutcomeKind | None = Field(None, description="the outcome's kind (None in reports from before it)")
    failure_at: datetime
    phases: list[Phase]
    spare_node: str | None = None
    replacement_seconds: float | None = None
    time_to_resume_seconds: float | None = None
    goodput: Goodput | None = Field(None, description="over every job with its terms known: their sums")
    lost_steps: int | None = None
    lost_seconds: float | None = None
    resumed_step: int | None = None
    latest_complete_step: int | None = None
    skipped_checkpoints: list[SkippedCheckpoint] = Field(default_factory=list)
    jobs: list[JobReport] = Field(default_factory=list)
    alerts: list[NodeFailureAlert] = Field(
        default_factory=list, description="the first and last few alerts of each source"
    )
    alert_counts: dict[str, int] = Field(default_factory=dict, description="alerts absorbed, per source")
    actions: list[ActionRecord] = Field(default_factory=list)
    decisions: list[DecisionRecord] = Field(default_factory=list)
    return_to_service: str | None = Field(
        None, description="the workflow id that returns the failed node to service once repaired"
    )
    dry_run: bool = False
    intended_actions: list[ActionRecord] = Field(
        default_factory=list, description="dry-run: each action the incident would have taken, not executed"
    )


VerifyRequest.model_rebuild()
