"""What the tests of the Kubernetes activities share: the activities built on the test API server
(or a real cluster), a stand-in for Slurm's view of a node, and a NodeSet controller stand-in."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from temporalio.testing import ActivityEnvironment

from activities.kubernetes import KubernetesActivities
from activities.platform import PlatformActivities
from backends.health import HealthCheck
from backends.kubernetes import load_api_client
from backends.slurm import SlurmNotFound, SlurmUnavailable
from contracts.k8s_settings import KubernetesSettings
from contracts.kubernetes import NODESET_GROUP, NODESET_PLURAL
from contracts.models import ActionContext, SlurmJob, SlurmNode

SLURMD_LABELS = {"app.kubernetes.io/name": "slurmd"}


def ctx(incident: str = "gpu-2-20261130T001736Z", *, dry_run: bool = False, xid: int = 79) -> ActionContext:
    return ActionContext(
        incident_id=incident,
        owner="recovery",
        actor="test",
        reason="GPU fell off the bus",
        xid=xid,
        mnemonic="ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        dry_run=dry_run,
    )


class SlurmStandIn:
    """Slurm's view of nodes, as the test sets it: `nodes` by name, `jobs`, and `unreadable`
    (every read fails as an unreachable slurmctld does)."""

    def __init__(self) -> None:
        self.nodes: dict[str, SlurmNode] = {}
        self.jobs: list[SlurmJob] = []
        self.unreadable = False

    def set(self, name: str, state: str, *flags: str, reason: str = "") -> None:
        self.nodes[name] = SlurmNode(name=name, state=state, flags=list(flags), reason=reason)

    async def get_node(self, name: str) -> SlurmNode:
        if self.unreadable:
            raise SlurmUnavailable("slurm_load_node: Unable to contact slurm controller (connect failure)")
        if name not in self.nodes:
            raise SlurmNotFound(f"node {name} is not known to slurmctld")
        return self.nodes[name]

    async def jobs_on_node(self, name: str) -> list[SlurmJob]:
        if self.unreadable:
            raise SlurmUnavailable("slurm_load_jobs: Unable to contact slurm controller (connect failure)")
        return [j for j in self.jobs if name in j.nodes and j.state == "RUNNING"]


def k8s_settings(kube_api, tmp_path: Path, **overrides) -> KubernetesSettings:
    values = dict(
        enabled=True,
        kubeconfig=Path(kube_api.kubeconfig(tmp_path / "kubeconfig")),
        nodeset_name="gpu",
        eviction_backoff_seconds=0.1,
        watch_seconds=1,
    )
    return KubernetesSettings(**(values | overrides))


class Recovery:
    """The activities as a worker builds them, run through temporalio's ActivityEnvironment
    (which records heartbeats)."""

    def __init__(self, settings: KubernetesSettings, slurm: SlurmStandIn, provider=None, health=None):
        self.loaded = load_api_client(settings)
        self.activities = KubernetesActivities(self.loaded.api, settings, slurm, provider, health)
        # The platform seam as the worker binds it on Slurm on Kubernetes.
        self.platform = PlatformActivities(self.activities.platform, health or HealthCheck([]))
        self.heartbeats: list[object] = []
        self.env = ActivityEnvironment()
        self.env.on_heartbeat = lambda *details: self.heartbeats.extend(details)

    async def run(self, activity, arg):
        return await self.env.run(activity, arg)

    def close(self) -> None:
        self.loaded.api.close()


def create_nodeset(api: client.ApiClient, namespace: str, name: str = "gpu", replicas: int = 2) -> dict:
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        NODESET_GROUP,
        "v1alpha1",
        namespace,
        NODESET_PLURAL,
        {
            "apiVersion": f"{NODESET_GROUP}/v1alpha1",
            "kind": "NodeSet",
            "metadata": {"name": name},
            "spec": {"replicas": replicas},
        },
    )


def slurmd_pod(seed, name: str, namespace: str, node: str, *, ready: bool = True, grace: int | None = None):
    return seed.pod(
        name, namespace, node=node, labels=SLURMD_LABELS, phase="Running" if ready else "Pending", grace=grace
    )


class NodeSetController:
    """Plays Slinky's NodeSet controller in DaemonSet mode: every Node that appears gets a
    slurmd pod bound to it (hostname = the pod's name), once the Node is Ready."""

    def __init__(self, seed, namespace: str, *, known: Iterable[str]):
        self._seed, self._namespace, self._known = seed, namespace, set(known)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        core = self._seed.core
        try:
            while not self._stopping.wait(0.05):
                for node in core.list_node().items:
                    name = node.metadata.name
                    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
                    if name not in self._known and ready:
                        self._known.add(name)
                        slurmd_pod(self._seed, f"slurmd-{name}", self._namespace, name)
        except ApiException as e:  # kept for stop() to raise in the test
            self.error = e

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)
        if self.error is not None:
            raise self.error


def rbac_rule_of(method: str, target: str) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) of one request, as the API server's authorizer derives it."""
    url = urlsplit(target)
    parts = [p for p in url.path.split("/") if p]
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    if method == "GET":
        watching = parse_qs(url.query).get("watch", [""])[0].lower() in ("true", "1")
        verb = "watch" if watching else ("get" if named else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
    return group, resource, verb
