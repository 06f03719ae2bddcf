"""Answers of the Kubernetes backends that are not results. `final` ones cannot change by retrying:
the activities raise them as non-retryable ApplicationErrors of the same type name."""

from __future__ import annotations


class KubeRecoveryError(Exception):
    final = True


class NodeNotFound(KubeRecoveryError):
    """The Kubernetes Node does not exist."""


class SlurmdPodNotFound(KubeRecoveryError):
    """No slurmd pod has this Slurm node name."""


class NodeSetNotFound(KubeRecoveryError):
    """The configured NodeSet does not exist (or its CRD version is not served)."""


class JobsStillRunning(KubeRecoveryError):
    """Slurm still runs a job on the node: its slurmd pod must not be evicted."""


class NodeStillBusy(KubeRecoveryError):
    """No job is listed on the node any more, but Slurm still shows it busy (a requeued job's
    processes completing). Retryable: it settles within moments; the activity's deadline turns a
    node that stays busy into a refusal."""

    final = False


class NodeNotDrained(KubeRecoveryError):
    """Slurm does not show the node drained: its slurmd pod must not be evicted."""


class EvictionBlocked(KubeRecoveryError):
    """A PodDisruptionBudget kept refusing the eviction until the deadline."""


class SlurmStateUnknown(KubeRecoveryError):
    """Slurm's view of the node could not be read. Retryable: the workflow's schedule-to-close
    deadline turns it into a fail-closed refusal when Slurm stays unreadable."""

    final = False


class ProviderUnavailable(KubeRecoveryError):
    """The replacement API could not be reached or answered 5xx; the request is safe to repeat."""

    final = False


class ConflictPersists(KubeRecoveryError):
    """An optimistic write kept meeting 409 Conflict (others writing the same object); retryable."""

    final = False
