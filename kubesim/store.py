"""The test server's state and write semantics: one store for every resource type, one
resourceVersion counter (as etcd's revision), and the event log that watches replay.

The store never changes a stored object in place: every write builds a new dict, so the event
log and running watches can share objects without copying them again.
"""

from __future__ import annotations

import base64
import bisect
import copy
import datetime
import math
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

from . import patch as patches, schemas
from .resources import BUILTIN_TYPES, ResourceType
from .selectors import SelectorError, from_label_selector, labels_match

NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet


class ApiError(Exception):
    """An error answer, sent as a metav1.Status body."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        rt: ResourceType | None = None,
        name: str | None = None,
        causes: list[dict] | None = None,
    ):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = {
            k: v
            for k, v in {
                "name": name,
                "group": rt.group if rt else None,
                "kind": rt.plural if rt else None,
                "causes": causes,
            }.items()
            if v
        }

    def status(self) -> dict:
        return status_body(self.code, self.reason, self.message, details=self.details, failure=True)


def status_body(code: int, reason: str, message: str, *, details: dict | None = None, failure: bool) -> dict:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if failure else "Success",
        "code": code,
    }
    body.update({k: v for k, v in {"reason": reason, "message": message, "details": details}.items() if v})
    return body


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', rt=rt, name=name)


def _conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}', rt=rt, name=name
    )


def _stale(rt: ResourceType, name: str) -> ApiError:
    return _conflict(
        rt, name, "the object has been modified; please apply your changes to the latest version and try again"
    )


def _invalid(rt: ResourceType, name: str, what: str) -> ApiError:
    return ApiError(422, "Invalid", f'{rt.kind} "{name}" is invalid: {what}', rt=rt, name=name)


def _admit(rt: ResourceType, obj: dict, builtin_schemas: str | None) -> None:
    """A custom object through its CRD's schema (defaults filled in, then validated), a built-in one
    through its type's schema in the `builtin_schemas` Kubernetes release, if set: 422 if it fails."""
    if rt.crd is not None:
        schemas.fill_defaults(rt.crd, rt.version, obj)
        found = schemas.problems(rt.crd, rt.version, obj)
    elif builtin_schemas is not None and not rt.custom:
        found = schemas.builtin_problems(builtin_schemas, obj)
    else:
        return
    if found:
        raise _invalid(rt, obj["metadata"].get("name", ""), ", ".join(found))


def _timestamp(after_seconds: float = 0) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=after_seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _path_get(obj: dict, dotted: str) -> object:
    for step in dotted.strip(".").split("."):
        obj = obj.get(step) if isinstance(obj, dict) else None
    return obj


def _path_set(obj: dict, dotted: str, value: object) -> None:
    *parents, last = dotted.strip(".").split(".")
    for step in parents:
        obj = obj.setdefault(step, {})
    obj[last] = value


def _ns_name(obj: dict) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    rt: ResourceType
    old: dict | None
    new: dict  # for DELETED, the last state at the deletion's resourceVersion


Matcher = Callable[[dict], bool]


def watch_view(event: Event, rt: ResourceType, namespace: str | None, match: Matcher) -> tuple[str, dict] | None:
    """What a watch of `rt` in `namespace` (None: all) with selector `match` sees of `event`: an
    object that starts matching is ADDED, one that stops matching is DELETED (as the apiserver's
    watch cache does)."""
    if (event.rt.group, event.rt.plural) != (rt.group, rt.plural):
        return None
    if namespace and event.new["metadata"].get("namespace") != namespace:
        return None
    now = match(event.new)
    if event.type != "MODIFIED":
        return (event.type, event.new) if now else None
    was = match(event.old)
    if was and not now:
        gone = copy.deepcopy(event.old)
        gone["metadata"]["resourceVersion"] = str(event.rv)
        return "DELETED", gone
    if now:
        return ("MODIFIED" if was else "ADDED"), event.new
    return None


def _unsupported(accepted: list[str]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
    )


def apply_patch(rt: ResourceType, name: str, content_type: str, original: dict, body: object) -> dict:
    if content_type not in patches.CONTENT_TYPES:
        raise _unsupported(list(patches.CONTENT_TYPES))
    try:
        return patches.apply(content_type, original, body, rt.merge_keys)
    except patches.PatchError as e:
        raise (bad_request(str(e)) if e.code == 400 else _invalid(rt, name, str(e))) from None


class Store:
    def __init__(self, *, add_not_ready_taint: bool = False):
        self.lock = threading.RLock()
        self.add_not_ready_taint = add_not_ready_taint
        # A Kubernetes release ("1.37.0"): every built-in object written is checked against its
        # type's schema there (about 10 ms a write, so only the tests that ask for it)
        self.builtin_schemas: str | None = None
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self._kinds: dict[tuple[str, str], ResourceType] = {}  # (group, plural) -> type
        self._objects: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
        self._rv = 0
        self._log: list[Event] = []
        self._compacted = 0
        self._listeners: list[Callable[[Event | None], None]] = []
        for rt in BUILTIN_TYPES:
            self.register(rt)
        for namespace in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(self.builtin("namespaces"), None, {"metadata": {"name": namespace}})

    # -- types -----------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        with self.lock:
            self.types[(rt.group, rt.version, rt.plural)] = rt
            self._kinds[(rt.group, rt.plural)] = rt
            self._objects.setdefault((rt.group, rt.plural), {})

    def builtin(self, plural: str, group: str = "") -> ResourceType:
        return self._kinds[(group, plural)]

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    # -- reads -----------------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        with self.lock:
            return self._get(rt, namespace, name)

    def _get(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        obj = self._objects[(rt.group, rt.plural)].get((namespace or "", name))
        if obj is None:
            raise _not_found(rt, name)
        return obj

    def list_objects(self, rt: ResourceType, namespace: str | None, match: Matcher) -> tuple[list[dict], str]:
        with self.lock:
            return self._select(rt, namespace, match), str(self._rv)

    def _select(self, rt: ResourceType, namespace: str | None, match: Matcher) -> list[dict]:
        objects = self._objects[(rt.group, rt.plural)]
        return [
            objects[key] for key in sorted(objects) if (not namespace or key[0] == namespace) and match(objects[key])
        ]

    # -- watch -----------------------------------------------------------------------------------

    def watch(
        self,
        rt: ResourceType,
        namespace: str | None,
        match: Matcher,
        resource_version: str | None,
        listener: Callable[[Event | None], None],
    ) -> list[tuple[str, dict]]:
        """Registers `listener` for every later event and returns what the watch sees first:
        synthetic ADDED for the current objects (no resourceVersion, or "0"), else the logged
        events after that resourceVersion. Raises a 410 Expired ApiError for a compacted one."""
        with self.lock:
            if resource_version in (None, "", "0"):
                initial = [("ADDED", obj) for obj in self._select(rt, namespace, match)]
            else:
                start = self._parse_rv(resource_version)
                if start < self._compacted:
                    raise ApiError(410, "Expired", f"too old resource version: {start} ({self._compacted})")
                first = bisect.bisect_right(self._log, start, key=lambda e: e.rv)
                initial = [seen for e in self._log[first:] if (seen := watch_view(e, rt, namespace, match))]
            self._listeners.append(listener)
            return initial

    def unwatch(self, listener: Callable[[Event | None], None]) -> None:
        with self.lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def close_watches(self) -> None:
        """Ends every watch (None is their end-of-stream), so the server can stop at once."""
        with self.lock:
            for listener in self._listeners:
                listener(None)
            self._listeners.clear()

    def compact(self) -> None:
        """Forgets the event log, as etcd compaction does: watches from an older resourceVersion
        now get 410 Expired and must list again."""
        with self.lock:
            self._compacted = self._rv
            self._log.clear()

    @staticmethod
    def _parse_rv(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise bad_request(f"invalid resource version: {value!r}") from None

    # -- writes ----------------------------------------------------------------------------------

    def _commit(self, kind: str, rt: ResourceType, old: dict | None, new: dict) -> dict:
        """Stores `new` (a dict nobody else holds) at the next resourceVersion and tells the watches."""
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        objects = self._objects[(rt.group, rt.plural)]
        if kind == "DELETED":
            objects.pop(_ns_name(new))
        else:
            objects[_ns_name(new)] = new
        event = Event(self._rv, kind, rt, old, new)
        self._log.append(event)
        for listener in self._listeners:
            listener(event)
        return new

    def create(self, rt: ResourceType, namespace: str | None, body: object, *, dry_run: bool = False) -> dict:
        if not isinstance(body, dict) or not isinstance(body.setdefault("metadata", {}), dict):
            raise bad_request("the body must be a JSON object with an object metadata")
        if body.get("kind") not in (None, rt.kind):
            raise bad_request(f"the kind {body['kind']!r} does not match the resource {rt.qualified}")
        obj, meta = copy.deepcopy(body), copy.deepcopy(body["metadata"])
        obj["metadata"] = meta
        with self.lock:
            if rt.namespaced:
                if meta.get("namespace") not in (None, "", namespace):
                    raise bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request"
                    )
                meta["namespace"] = namespace
                if ("", namespace) not in self._objects[("", "namespaces")]:
                    raise _not_found(self.builtin("namespaces"), namespace)
            else:
                meta.pop("namespace", None)
            objects = self._objects[(rt.group, rt.plural)]
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise _invalid(rt, "", "metadata.name: Required value: name or generateName is required")
                while not meta.get("name") or _ns_name(obj) in objects:
                    meta["name"] = meta["generateName"] + "".join(random.choices(_NAME_CHARS, k=5))
            if _ns_name(obj) in objects:
                raise ApiError(
                    409, "AlreadyExists", f'{rt.qualified} "{meta["name"]}" already exists', rt=rt, name=meta["name"]
                )
            for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds", "generation", "resourceVersion"):
                meta.pop(server_owned, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_timestamp())
            if rt.generation:
                meta["generation"] = 1
            obj["kind"], obj["apiVersion"] = rt.kind, rt.api_version
            if rt.initial_status is not None:
                obj["status"] = copy.deepcopy(rt.initial_status)
                if not obj["status"]:
                    del obj["status"]
            self._normalize(rt, obj)
            _admit(rt, obj, self.builtin_schemas)
            if rt.plural == "nodes" and not rt.group and self.add_not_ready_taint:
                # The TaintNodesByCondition admission plugin: every new Node starts not-ready.
                self._set_not_ready_taint(obj, True)
            if dry_run:
                return obj
            self._commit("ADDED", rt, None, obj)
            self._node_lifecycle(rt, obj)
            return obj

    def replace(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: object,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict:
        if not isinstance(body, dict) or not isinstance(body.setdefault("metadata", {}), dict):
            raise bad_request("the body must be a JSON object with an object metadata")
        if body["metadata"].get("name") not in (None, name):
            raise bad_request(
                f"the name of the object ({body['metadata']['name']}) does not match the name on the URL ({name})"
            )
        if rt.custom and not body["metadata"].get("resourceVersion"):
            raise _invalid(rt, name, "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")
        with self.lock:
            old = self._get(rt, namespace, name)
            return self._update(rt, old, copy.deepcopy(body), subresource, dry_run)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        body: object,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict:
        if rt.custom and content_type == patches.STRATEGIC:  # CRs have no Go types to carry merge keys
            raise _unsupported([patches.JSON_PATCH, patches.MERGE])
        with self.lock:
            old = self._get(rt, namespace, name)
            return self._update(rt, old, apply_patch(rt, name, content_type, old, body), subresource, dry_run)

    def _update(self, rt: ResourceType, old: dict, new: dict, subresource: str | None, dry_run: bool) -> dict:
        """The apiserver's update path, shared by PUT, PATCH and /scale: resourceVersion
        precondition, what the (sub)resource may change, no-op detection, generation, finalizers."""
        namespace, name = _ns_name(old)
        meta = new.get("metadata") if isinstance(new.get("metadata"), dict) else {}
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise _stale(rt, name)
        if subresource == "status":
            result = copy.deepcopy(old)
            result.pop("status", None)
            if "status" in new:
                result["status"] = new["status"]
        else:
            result = new
            result["metadata"] = meta
            for owned in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "namespace",
                "name",
            ):
                meta.pop(owned, None)
                if owned in old["metadata"]:
                    meta[owned] = old["metadata"][owned]
            if rt.status:  # the main resource ignores status: only /status writes it
                result.pop("status", None)
                if "status" in old:
                    result["status"] = copy.deepcopy(old["status"])
        self._normalize(rt, result)
        result["kind"], result["apiVersion"] = rt.kind, rt.api_version
        _admit(rt, result, self.builtin_schemas)
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if result == old:  # a no-op write stores nothing and keeps the resourceVersion
            return old
        if rt.generation and self._spec(result) != self._spec(old):
            result["metadata"]["generation"] = old["metadata"].get("generation", 0) + 1
        if dry_run:
            return result
        if self._finalized(result):
            return self._commit("DELETED", rt, old, result)
        self._commit("MODIFIED", rt, old, result)
        self._node_lifecycle(rt, result)
        return result

    @staticmethod
    def _spec(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    @staticmethod
    def _finalized(obj: dict) -> bool:
        """Terminating, with no finalizer and no grace period left: the object goes."""
        meta = obj["metadata"]
        return (
            bool(meta.get("deletionTimestamp"))
            and not meta.get("finalizers")
            and not meta.get("deletionGracePeriodSeconds")
        )

    @staticmethod
    def _normalize(rt: ResourceType, obj: dict) -> None:
        for key in rt.always:
            if not isinstance(obj.get(key), dict):
                obj[key] = {}
        # Secret.stringData is write-only: the apiserver folds it into base64 `data`.
        if rt.kind == "Secret" and not rt.group and "stringData" in obj:
            data = obj.setdefault("data", {})
            for key, value in (obj.pop("stringData") or {}).items():
                data[key] = base64.b64encode(str(value).encode()).decode()

    # -- delete ----------------------------------------------------------------------------------

    def delete(
        self, rt: ResourceType, namespace: str | None, name: str, options: dict, *, dry_run: bool = False
    ) -> tuple[dict, bool]:
        """Returns the object and whether it is gone; otherwise it is now Terminating, waiting for
        its finalizers or (a pod on a node) for the kubelet."""
        with self.lock:
            old = self._get(rt, namespace, name)
            meta = old["metadata"]
            pre = options.get("preconditions") or {}
            for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                if pre.get(field) and pre[field] != meta[field]:
                    raise _conflict(
                        rt,
                        name,
                        f"Precondition failed: {label} in precondition: {pre[field]}, "
                        f"{label} in object meta: {meta[field]}",
                    )
            grace = self._grace_period(rt, old, options.get("gracePeriodSeconds"))
            if meta.get("deletionTimestamp") and grace >= (meta.get("deletionGracePeriodSeconds") or 0):
                return old, False  # already Terminating; only a shorter grace period changes anything
            new = copy.deepcopy(old)
            if grace or meta.get("finalizers") or meta.get("deletionTimestamp"):
                new["metadata"].update(deletionTimestamp=_timestamp(grace), deletionGracePeriodSeconds=grace)
            gone = self._finalized(new) or not new["metadata"].get("deletionTimestamp")
            if dry_run:
                return new, gone
            if gone and rt.plural == "namespaces" and not rt.group:
                self._empty_namespace(name)
            return self._commit("DELETED" if gone else "MODIFIED", rt, old, new), gone

    @staticmethod
    def _grace_period(rt: ResourceType, obj: dict, requested: object) -> int:
        """Only pods on a node that have not finished get a grace period (default: their own
        terminationGracePeriodSeconds, else 30 s); everything else is deleted at once."""
        if rt.kind != "Pod" or rt.group:
            return 0
        if not (obj.get("spec") or {}).get("nodeName") or (obj.get("status") or {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return 0
        if requested is not None:
            try:
                return max(0, int(requested))
            except (TypeError, ValueError):
                raise bad_request(f"invalid gracePeriodSeconds: {requested!r}") from None
        spec_grace = obj["spec"].get("terminationGracePeriodSeconds")
        return 30 if spec_grace is None else int(spec_grace)

    def _empty_namespace(self, namespace: str) -> None:
        # What the namespace controller does while a real namespace is Terminating, at once.
        for kind, objects in self._objects.items():
            for key in [key for key in objects if key[0] == namespace]:
                self._commit("DELETED", self._kinds[kind], objects[key], copy.deepcopy(objects[key]))

    def finish_terminating_pods(self, node: str | None = None) -> int:
        """Plays the kubelet: every Terminating pod (on `node`, or on any) is deleted for good,
        as the kubelet's final grace-period-0 delete does. Returns how many pods went."""
        pods = self.builtin("pods")
        with self.lock:
            terminating = [
                p
                for p in self._objects[("", "pods")].values()
                if p["metadata"].get("deletionTimestamp")
                and (node is None or (p.get("spec") or {}).get("nodeName") == node)
            ]
            return sum(self.delete(pods, *_ns_name(p), {"gracePeriodSeconds": 0})[1] for p in terminating)

    # -- eviction --------------------------------------------------------------------------------

    def evict(self, namespace: str, name: str, eviction: object, *, dry_run: bool = False) -> None:
        """policy/v1 Eviction: the pod is deleted (gracefully) unless its PodDisruptionBudget
        allows no disruption, which is 429 TooManyRequests with a DisruptionBudget cause."""
        if not isinstance(eviction, dict):
            raise bad_request("the body must be a policy/v1 Eviction")
        pods = self.builtin("pods")
        with self.lock:
            pod = self._get(pods, namespace, name)
            # A pod that is not running, or already Terminating, disrupts nothing more.
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed", "Pending") and not pod[
                "metadata"
            ].get("deletionTimestamp"):
                budgets = [
                    b
                    for b in self._objects[("policy", "poddisruptionbudgets")].values()
                    if b["metadata"]["namespace"] == namespace and self._selects(b, pod)
                ]
                if len(budgets) > 1:
                    raise ApiError(
                        500,
                        "InternalError",
                        "This pod has more than one PodDisruptionBudget, "
                        "which the eviction subresource does not support.",
                    )
                if budgets:
                    self._check_budget(budgets[0], namespace)
            self.delete(pods, namespace, name, eviction.get("deleteOptions") or {}, dry_run=dry_run)

    @staticmethod
    def _selects(budget: dict, pod: dict) -> bool:
        selector = (budget.get("spec") or {}).get("selector")
        if selector is None:  # policy/v1: a null selector selects nothing, an empty one everything
            return False
        try:
            return labels_match(from_label_selector(selector), pod)
        except SelectorError as e:
            raise ApiError(500, "InternalError", f"invalid PodDisruptionBudget selector: {e}") from None

    def _check_budget(self, budget: dict, namespace: str) -> None:
        # The disruption controller's arithmetic, done at eviction time: "healthy" is any matching
        # pod that is not Terminating.
        matching = [
            p
            for p in self._objects[("", "pods")].values()
            if p["metadata"]["namespace"] == namespace and self._selects(budget, p)
        ]
        healthy = sum(1 for p in matching if not p["metadata"].get("deletionTimestamp"))
        expected, spec = len(matching), budget.get("spec") or {}

        def scaled(value: object) -> int:
            if isinstance(value, str) and value.endswith("%"):
                return math.ceil(int(value[:-1]) * expected / 100)
            return int(value)

        try:
            if spec.get("maxUnavailable") is not None:
                desired = expected - scaled(spec["maxUnavailable"])
            else:
                desired = scaled(spec.get("minAvailable", 1))  # policy/v1 defaults minAvailable to 1
        except ValueError:
            raise ApiError(500, "InternalError", f"invalid PodDisruptionBudget {budget['metadata']['name']}") from None
        if healthy - desired <= 0:
            pdb = budget["metadata"]["name"]
            raise ApiError(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {pdb} needs "
                        f"{desired} healthy pods and has {healthy} currently",
                    }
                ],
            )

    # -- scale -----------------------------------------------------------------------------------

    def scale(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        with self.lock:
            return self._scale_of(rt, self._get(rt, namespace, name))

    @staticmethod
    def _scale_of(rt: ResourceType, obj: dict) -> dict:
        meta = {
            k: obj["metadata"][k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in obj["metadata"]
        }
        spec_path, status_path = rt.scale
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": meta,
            "spec": {"replicas": _path_get(obj, spec_path) or 0},
            "status": {"replicas": _path_get(obj, status_path) or 0},
        }

    def write_scale(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        change: Callable[[dict], object],
        *,
        dry_run: bool = False,
    ) -> dict:
        """PUT or PATCH of /scale: `change` turns the current Scale into the requested one."""
        with self.lock:
            old = self._get(rt, namespace, name)
            wanted = change(self._scale_of(rt, old))
            if not isinstance(wanted, dict):
                raise bad_request("the body must be an autoscaling/v1 Scale")
            replicas = (wanted.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                raise _invalid(rt, name, f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer")
            new = copy.deepcopy(old)
            new["metadata"]["resourceVersion"] = (wanted.get("metadata") or {}).get("resourceVersion")
            _path_set(new, rt.scale[0], replicas)
            return self._scale_of(rt, self._update(rt, old, new, None, dry_run))

    # -- node lifecycle (only with add_not_ready_taint) ------------------------------------------

    @staticmethod
    def _set_not_ready_taint(node: dict, present: bool) -> None:
        spec = node.setdefault("spec", {})
        taints = [t for t in spec.get("taints") or [] if t.get("key") != NOT_READY_TAINT["key"]]
        spec["taints"] = taints + [dict(NOT_READY_TAINT)] if present else taints
        if not spec["taints"]:
            del spec["taints"]

    def _node_lifecycle(self, rt: ResourceType, node: dict) -> None:
        """The node lifecycle controller, in a write of its own right after the Node's: the
        not-ready taint follows the Ready condition."""
        if not (self.add_not_ready_taint and rt.plural == "nodes" and not rt.group):
            return
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (node.get("status") or {}).get("conditions") or []
        )
        tainted = any(t.get("key") == NOT_READY_TAINT["key"] for t in (node.get("spec") or {}).get("taints") or [])
        if ready == tainted:
            new = copy.deepcopy(node)
            self._set_not_ready_taint(new, not ready)
            self._commit("MODIFIED", rt, node, new)
