"""What every Kubernetes backend shares: blocking calls off the event loop, optimistic writes that
retry on 409 Conflict, and waits built on a watch that relists on 410 Gone.

The official client is synchronous (urllib3): each call runs in a worker thread so the activity's
event loop keeps heartbeating, and each watch is bounded by its server-side timeoutSeconds so a
thread never outlives the wait that started it by more than one window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kubernetes import watch
from kubernetes.client import V1Node, V1NodeSpec, V1NodeStatus, V1ObjectMeta, V1Pod, V1PodSpec
from kubernetes.client.exceptions import ApiException

from backends.kubernetes.errors import ConflictPersists

T = TypeVar("T")
R = TypeVar("R")
Progress = Callable[[str], None]
CONFLICT_ATTEMPTS = 10
# A watch window's read time-out: its timeoutSeconds, and time for the server to close it.
WATCH_GRACE_SECONDS = 10


async def call(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


# The client's models type every field optional. An object the API server sends always has its
# metadata (with a name and a uid), and a Node or a pod its spec and status: these say so to the
# type checker, and fail loudly on an object that does not.


def meta(obj: V1Node | V1Pod) -> V1ObjectMeta:
    return _sent(obj.metadata, obj, "metadata")


def uid_of(obj: V1Node | V1Pod) -> str:
    return _sent(meta(obj).uid, obj, "metadata.uid")


def node_spec(node: V1Node) -> V1NodeSpec:
    return _sent(node.spec, node, "spec")


def node_status(node: V1Node) -> V1NodeStatus:
    return _sent(node.status, node, "status")


def pod_spec(pod: V1Pod) -> V1PodSpec:
    return _sent(pod.spec, pod, "spec")


def _sent(value: T | None, obj: object, field: str) -> T:
    if value is None:
        raise ValueError(f"a {type(obj).__name__} without {field}: not as the API server sends it")
    return value


def status_of(error: BaseException) -> int | None:
    return error.status if isinstance(error, ApiException) else None


async def update_optimistically(
    read: Callable[[], Awaitable[T]],
    write: Callable[[T], Awaitable[R]],
    what: str,
) -> R:
    """Read, let `write` change and PUT the object with the resourceVersion it was read at, and
    start over on 409 Conflict: a write never overwrites a change it did not see (a taint another
    owner added meanwhile survives). `write` returns what the caller wants back."""
    for _ in range(CONFLICT_ATTEMPTS):
        current = await read()
        try:
            return await write(current)
        except ApiException as e:
            if e.status != 409:
                raise
    raise ConflictPersists(f"{what}: still 409 Conflict after {CONFLICT_ATTEMPTS} fresh reads")


async def watch_until(
    list_fn: Callable[..., Any],
    check: Callable[[dict[str, Any]], Awaitable[tuple[T | None, str]]],
    *,
    deadline: float,
    watch_seconds: int,
    progress: Progress,
    **list_kwargs: Any,
) -> tuple[T | None, str]:
    """Keep a cache of the objects `list_fn` lists (by name), run `check` on it after the list and
    after each watch window, until `check` returns a result or the monotonic `deadline` passes.

    A window is one watch from the last resourceVersion seen, with timeoutSeconds, ended early by
    the first event; `check` also runs when a window passes without events, since it may look at
    state that no watch shows (Slurm). 410 Gone (the resourceVersion was compacted away) relists.
    Returns (result or None, what `check` said last)."""
    objects: dict[str, Any] = {}
    resource_version: str | None = None
    detail = "not checked yet"
    while True:
        if resource_version is None:
            listed = await call(list_fn, **list_kwargs)
            objects = {item.metadata.name: item for item in listed.items}
            resource_version = listed.metadata.resource_version
        found, detail = await check(objects)
        if found is not None:
            return found, detail
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, detail
        progress(detail)
        window = max(1, min(watch_seconds, int(remaining + 0.999)))
        try:
            resource_version = await call(_watch_window, list_fn, objects, resource_version, window, list_kwargs)
        except ApiException as e:
            if e.status != 410:
                raise
            resource_version = None


def _watch_window(
    list_fn: Callable[..., Any],
    objects: dict[str, Any],
    resource_version: str,
    seconds: int,
    list_kwargs: dict[str, Any],
) -> str:
    """One watch (in a worker thread): applies the first event to `objects`, returns the
    resourceVersion to go on from."""
    stream = watch.Watch()
    for event in stream.stream(
        list_fn,
        resource_version=resource_version,
        timeout_seconds=seconds,
        allow_watch_bookmarks=True,
        _request_timeout=seconds + WATCH_GRACE_SECONDS,
        **list_kwargs,
    ):
        obj = event["object"]
        if event["type"] == "DELETED":
            objects.pop(obj.metadata.name, None)
        elif event["type"] in ("ADDED", "MODIFIED"):
            objects[obj.metadata.name] = obj
        if event["type"] != "BOOKMARK":
            stream.stop()
    return stream.resource_version or resource_version
