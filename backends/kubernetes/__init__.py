"""Slurm on Kubernetes (Slinky's slurm-operator): the Node under a failed Slurm node, its slurmd
pod, and replacement capacity, through the official client over one ApiClient per worker.

Every request goes through an entry of `calls.API_CALLS`, which is also what the shipped RBAC
grants (deploy/kubernetes/rbac.yaml).
"""

from backends.kubernetes.config import LoadedClient, NoKubernetesConfig, load_api_client
from backends.kubernetes.errors import (
    ConflictPersists,
    EvictionBlocked,
    JobsStillRunning,
    KubeRecoveryError,
    NodeNotDrained,
    NodeNotFound,
    NodeSetNotFound,
    NodeStillBusy,
    ProviderUnavailable,
    SlurmdPodNotFound,
    SlurmStateUnknown,
)
from backends.kubernetes.nodes import NodeFencing
from backends.kubernetes.pods import SlurmdPods
from backends.kubernetes.providers import (
    HttpReplacement,
    KubernetesReplacementProvider,
    NodeLifecycleReplacement,
    NodeSetReplacement,
)
from backends.kubernetes.slurm_view import SlurmNodeView, confirm_evictable
from backends.kubernetes.spares import SpareWatch

__all__ = [
    "ConflictPersists",
    "EvictionBlocked",
    "HttpReplacement",
    "JobsStillRunning",
    "NodeStillBusy",
    "KubeRecoveryError",
    "KubernetesReplacementProvider",
    "LoadedClient",
    "NoKubernetesConfig",
    "NodeFencing",
    "NodeLifecycleReplacement",
    "NodeNotDrained",
    "NodeNotFound",
    "NodeSetNotFound",
    "NodeSetReplacement",
    "ProviderUnavailable",
    "SlurmNodeView",
    "SlurmStateUnknown",
    "SlurmdPodNotFound",
    "SlurmdPods",
    "SpareWatch",
    "confirm_evictable",
    "load_api_client",
]
