"""The resource types the test server serves, and what sets each apart.

Each built-in type carries the few facts of the real API that a controller's correctness depends
on: whether it has a /status subresource (then writes to the main resource keep the stored
status), whether the server keeps metadata.generation, what status a create starts from, and the
strategic-merge-patch keys of its lists (from the Go types' patchMergeKey/patchStrategy tags; a
list without one, such as Node spec.taints, is replaced whole). Custom resources are registered
with `KubeApiServer.register_crd`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A strategic-merge list of scalars merged as a set (patchStrategy=merge without a merge key).
SET = "$set"

# metadata lists every type shares.
_META_KEYS = {"metadata.ownerReferences": "uid", "metadata.finalizers": SET}

_CONTAINER = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath", "volumeDevices": "devicePath"}
_POD_KEYS = {
    **_META_KEYS,
    **{f"spec.{containers}": "name" for containers in ("containers", "initContainers", "ephemeralContainers")},
    **{f"spec.{c}[].{k}": key for c in ("containers", "initContainers") for k, key in _CONTAINER.items()},
    "spec.volumes": "name",
    "spec.imagePullSecrets": "name",
    "status.conditions": "type",
    "status.podIPs": "ip",
}
# spec.taints has no patch strategy (+listType=atomic): a strategic merge replaces the whole list.
_NODE_KEYS = {**_META_KEYS, "status.conditions": "type", "status.addresses": "type"}
_CONDITIONS_KEYS = {**_META_KEYS, "status.conditions": "type"}


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    status: bool = False  # has /status: main writes keep the stored status, /status writes change only it
    generation: bool = False  # metadata.generation counts changes outside metadata and status
    initial_status: dict | None = None  # the status a create starts from (None: keep the client's)
    merge_keys: dict[str, str] = field(default_factory=lambda: dict(_META_KEYS))
    scale: tuple[str, str] | None = None  # dotted paths behind /scale: (spec replicas, status replicas)
    custom: bool = False  # a CR: no strategic merge (415), PUT must carry a resourceVersion
    always: tuple[str, ...] = ()  # top-level objects a Go struct always serializes, if only as {}
    crd: str | None = None  # a CR whose schema (kubesim/crds/<crd>, this version) defaults and validates writes

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """The name in error messages: `nodes`, `nodesets.slinky.slurm.net`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def discovery(self) -> list[dict]:
        """This type's entries in its group-version's APIResourceList."""
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        entries = [
            {
                "name": self.plural,
                "singularName": self.kind.lower(),
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": verbs,
            }
        ]
        if self.status:
            entries.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if self.scale:
            entries.append(
                {
                    "name": f"{self.plural}/scale",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": ["get", "patch", "update"],
                }
            )
        if self.plural == "pods" and not self.group:
            entries.append(
                {
                    "name": "pods/eviction",
                    "singularName": "",
                    "namespaced": True,
                    "group": "policy",
                    "version": "v1",
                    "kind": "Eviction",
                    "verbs": ["create"],
                }
            )
        return entries


BUILTIN_TYPES = [
    ResourceType(
        "",
        "v1",
        "namespaces",
        "Namespace",
        namespaced=False,
        status=True,
        initial_status={"phase": "Active"},
        merge_keys=_CONDITIONS_KEYS,
        always=("spec", "status"),
    ),
    ResourceType(
        "", "v1", "nodes", "Node", namespaced=False, status=True, merge_keys=_NODE_KEYS, always=("spec", "status")
    ),
    ResourceType(
        "",
        "v1",
        "pods",
        "Pod",
        namespaced=True,
        status=True,
        generation=True,
        initial_status={"phase": "Pending"},
        merge_keys=_POD_KEYS,
        always=("spec", "status"),
    ),
    ResourceType("", "v1", "events", "Event", namespaced=True),
    ResourceType("", "v1", "configmaps", "ConfigMap", namespaced=True),
    ResourceType("", "v1", "secrets", "Secret", namespaced=True),
    ResourceType(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        namespaced=True,
        status=True,
        generation=True,
        merge_keys=_CONDITIONS_KEYS,
        always=("spec", "status"),
        initial_status={"disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0},
    ),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True, always=("spec",)),
]


def custom_type(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool,
    scale: tuple[str, str] | None,
    crd: str | None = None,
) -> ResourceType:
    """A CRD's type as the apiserver serves it with `subresources: {status: {}, scale: {...}}`."""
    return ResourceType(
        group,
        version,
        plural,
        kind,
        namespaced=namespaced,
        status=True,
        generation=True,
        initial_status={},
        scale=scale,
        custom=True,
        crd=crd,
    )
