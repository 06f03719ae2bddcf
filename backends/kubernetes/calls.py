"""Every Kubernetes API request the backends make, with the RBAC rule it needs.

The backends name the entry of each request they make, so the audit record carries its exact
method and path; deploy/kubernetes/rbac.yaml grants exactly these rules, and the tests check
both sides: the manifests against this table, and the test API server's request log against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from contracts.kubernetes import NODESET_GROUP, NODESET_PLURAL
from contracts.models import Invocation

PATH = "kubernetes"  # the ActionRecord path of every call made here


@dataclass(frozen=True)
class ApiCall:
    method: str
    path: str  # a template: {name}, {namespace}, {version}
    group: str  # the API group, "" for core
    resource: str  # as RBAC names it, with the subresource: "pods/eviction"
    verb: str
    namespaced: bool = False

    def invocation(self, *, dry_run: bool, body: Any, **names: str) -> Invocation:
        """The exact call, for the audit record: method, path, and the JSON of what it changes."""
        command = f"{self.method} {self.path.format(**names)} {json.dumps(body, sort_keys=True, default=str)}"
        return Invocation(path=PATH, command=command, executed=not dry_run)


_NODESET = "/apis/" + NODESET_GROUP + "/{version}/namespaces/{namespace}/" + NODESET_PLURAL + "/{name}"

READ_NODE = ApiCall("GET", "/api/v1/nodes/{name}", "", "nodes", "get")
LIST_NODES = ApiCall("GET", "/api/v1/nodes", "", "nodes", "list")
WATCH_NODES = ApiCall("GET", "/api/v1/nodes?watch=true", "", "nodes", "watch")
UPDATE_NODE = ApiCall("PUT", "/api/v1/nodes/{name}", "", "nodes", "update")
UPDATE_NODE_STATUS = ApiCall("PUT", "/api/v1/nodes/{name}/status", "", "nodes/status", "update")
DELETE_NODE = ApiCall("DELETE", "/api/v1/nodes/{name}", "", "nodes", "delete")
LIST_PODS = ApiCall("GET", "/api/v1/namespaces/{namespace}/pods", "", "pods", "list", namespaced=True)
WATCH_PODS = ApiCall("GET", "/api/v1/namespaces/{namespace}/pods?watch=true", "", "pods", "watch", namespaced=True)
EVICT_POD = ApiCall(
    "POST", "/api/v1/namespaces/{namespace}/pods/{name}/eviction", "", "pods/eviction", "create", namespaced=True
)
READ_NODESET = ApiCall("GET", _NODESET, NODESET_GROUP, NODESET_PLURAL, "get", namespaced=True)
UPDATE_NODESET = ApiCall("PUT", _NODESET, NODESET_GROUP, NODESET_PLURAL, "update", namespaced=True)
READ_NODESET_SCALE = ApiCall(
    "GET", _NODESET + "/scale", NODESET_GROUP, NODESET_PLURAL + "/scale", "get", namespaced=True
)
UPDATE_NODESET_SCALE = ApiCall(
    "PUT", _NODESET + "/scale", NODESET_GROUP, NODESET_PLURAL + "/scale", "update", namespaced=True
)

API_CALLS: tuple[ApiCall, ...] = (
    READ_NODE,
    LIST_NODES,
    WATCH_NODES,
    UPDATE_NODE,
    UPDATE_NODE_STATUS,
    DELETE_NODE,
    LIST_PODS,
    WATCH_PODS,
    EVICT_POD,
    READ_NODESET,
    UPDATE_NODESET,
    READ_NODESET_SCALE,
    UPDATE_NODESET_SCALE,
)


def rbac_rules(*, namespaced: bool) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the code needs: cluster-wide (Nodes) or in the Slurm namespace."""
    return {(c.group, c.resource, c.verb) for c in API_CALLS if c.namespaced == namespaced}
