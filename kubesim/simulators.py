"""The cluster's other actors, for scenario tests: each runs in a background thread and talks to
the API server over HTTP with the official client, as the real one would.

    Kubelet(api_client, *, node=None, finish_after=None, interval=0.05, pre_stop=None)
        Finishes pod termination: a Terminating pod (on `node`, or on any node) is deleted for good
        (grace period 0, UID precondition, as the kubelet does) when its grace period ends, or
        `finish_after` seconds after it was first seen Terminating if that is sooner (a job that
        exits on SIGTERM). `pre_stop(pod)` runs once per pod when it is first seen Terminating, as
        a container's preStop hook. `finished` lists "namespace/name" of the pods it removed.

    Provisioner(api_client, *, name_pattern="gpu-new-{n}", replace_label=None, ready_after=0.5,
                gpus=8, labels=None, interval=0.05, nodeset_version="v1beta1")
        Plays the cloud provider and node bootstrap: when a Node is deleted, when a Node gets the
        label `replace_label`, or when a NodeSet (slinky.slurm.net/<nodeset_version>) is scaled up (one per
        added replica; a NodeSet first seen after start() counts from 0), it creates a Node named
        name_pattern.format(n=<lowest unused n>) that is NotReady, and `ready_after` seconds later
        makes it Ready with `gpus` nvidia.com/gpu in capacity and allocatable; a NodeSet's
        status.replicas then counts the Node in. `created` lists the Nodes it made.

Both: start() (takes the baseline, then returns self), stop() (joins the thread; re-raises what
the thread failed with), use as a context manager, `ticks` (rounds done) and `error`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

# Today's Slinky (slurm-operator 1.x): slinky.slurm.net/v1beta1
NODESET = ("slinky.slurm.net", "v1beta1", "nodesets")


class _Simulator:
    def __init__(self, api_client: client.ApiClient, interval: float):
        # An ApiClient of its own: the thread never shares a connection pool with the test.
        self._api = client.ApiClient(api_client.configuration)
        self._interval = interval
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.ticks = 0  # rounds done, for a test that must let a few pass to see that nothing happens

    def start(self):
        self._baseline()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)
        self._api.close()
        if self.error is not None:
            raise RuntimeError(f"the {type(self).__name__} simulator failed: {self.error!r}") from self.error

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stopping.wait(self._interval):
                self._tick()
                self.ticks += 1
        except Exception as e:  # kept for stop() to raise in the test's thread
            self.error = e

    def _baseline(self) -> None:
        pass

    def _tick(self) -> None:
        raise NotImplementedError


class Kubelet(_Simulator):
    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        node: str | None = None,
        finish_after: float | None = None,
        interval: float = 0.05,
        pre_stop: Callable[[client.V1Pod], None] | None = None,
    ):
        super().__init__(api_client, interval)
        self.node, self.finish_after, self._pre_stop = node, finish_after, pre_stop
        self.finished: list[str] = []
        self._done: set[str] = set()  # pod UIDs
        self._first_seen: dict[str, float] = {}

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        selector = f"spec.nodeName={self.node}" if self.node else None
        now = time.time()
        for pod in core.list_pod_for_all_namespaces(field_selector=selector).items:
            meta = pod.metadata
            if meta.deletion_timestamp is None or not pod.spec.node_name or meta.uid in self._done:
                continue
            if meta.uid not in self._first_seen and self._pre_stop is not None:
                self._pre_stop(pod)  # the container's preStop hook runs before it is sent SIGTERM
            first_seen = self._first_seen.setdefault(meta.uid, now)
            due = meta.deletion_timestamp.timestamp()
            if self.finish_after is not None:
                due = min(due, first_seen + self.finish_after)
            if now < due:
                continue
            try:
                core.delete_namespaced_pod(
                    meta.name,
                    meta.namespace,
                    body=client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta.uid)
                    ),
                )
            except ApiException as e:
                if e.status not in (404, 409):  # gone already, or a new pod of the same name
                    raise
            self._done.add(meta.uid)
            self.finished.append(f"{meta.namespace}/{meta.name}")


class Provisioner(_Simulator):
    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        name_pattern: str = "gpu-new-{n}",
        replace_label: str | None = None,
        ready_after: float = 0.5,
        gpus: int = 8,
        labels: dict[str, str] | None = None,
        interval: float = 0.05,
        nodeset_version: str = NODESET[1],
    ):
        super().__init__(api_client, interval)
        self._nodeset = (NODESET[0], nodeset_version, NODESET[2])
        self.name_pattern, self.replace_label, self.ready_after = name_pattern, replace_label, ready_after
        self.gpus, self.labels = gpus, dict(labels or {})
        self.created: list[str] = []
        self._nodes: set[str] = set()
        self._replaced: set[str] = set()
        self._replicas: dict[tuple[str, str], int] = {}
        self._booting: list[tuple[float, str, tuple[str, str] | None]] = []  # (ready at, node, its NodeSet)

    def _baseline(self) -> None:
        self._nodes = {n.metadata.name for n in client.CoreV1Api(self._api).list_node().items}
        self._replicas = {key: replicas for key, replicas in self._nodesets()}

    def _nodesets(self) -> list[tuple[tuple[str, str], int]]:
        try:
            items = client.CustomObjectsApi(self._api).list_cluster_custom_object(*self._nodeset)["items"]
        except ApiException as e:
            if e.status == 404:  # no NodeSet CRD on this server
                return []
            raise
        return [
            ((o["metadata"]["namespace"], o["metadata"]["name"]), (o.get("spec") or {}).get("replicas") or 0)
            for o in items
        ]

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        nodes = core.list_node().items
        names = {n.metadata.name for n in nodes}
        wanted: list[tuple[str, str] | None] = [None] * len(self._nodes - names)  # deleted Nodes
        for node in nodes:
            if (
                self.replace_label
                and self.replace_label in (node.metadata.labels or {})
                and node.metadata.name not in self._replaced
            ):
                self._replaced.add(node.metadata.name)
                wanted.append(None)
        for key, replicas in self._nodesets():
            wanted += [key] * max(0, replicas - self._replicas.get(key, 0))
            self._replicas[key] = replicas
        for nodeset in wanted:
            name = self._create_node(core, names)
            names.add(name)
            self._booting.append((time.monotonic() + self.ready_after, name, nodeset))
        self._nodes = names
        for booting in [b for b in self._booting if b[0] <= time.monotonic()]:
            self._booting.remove(booting)
            self._make_ready(core, booting[1], booting[2])

    def _create_node(self, core: client.CoreV1Api, existing: set[str]) -> str:
        n = 0
        while self.name_pattern.format(n=n) in existing or self.name_pattern.format(n=n) in self.created:
            n += 1
        name = self.name_pattern.format(n=n)
        core.create_node(
            {
                "metadata": {"name": name, "labels": self.labels},
                "status": {
                    "conditions": [
                        {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "node is booting"}
                    ]
                },
            }
        )
        self.created.append(name)
        return name

    def _make_ready(self, core: client.CoreV1Api, name: str, nodeset: tuple[str, str] | None) -> None:
        gpus = {"nvidia.com/gpu": str(self.gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
        core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": gpus,
                    "allocatable": gpus,
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                        }
                    ],
                }
            },
        )
        if nodeset is not None:
            custom = client.CustomObjectsApi(self._api)
            group, version, plural = self._nodeset
            current = custom.get_namespaced_custom_object(group, version, nodeset[0], plural, nodeset[1])
            ready = ((current.get("status") or {}).get("replicas") or 0) + 1
            custom.patch_namespaced_custom_object_status(
                group, version, nodeset[0], plural, nodeset[1], {"status": {"replicas": ready}}
            )
