"""Watch: JSON lines of events, from a resourceVersion or from a synthetic ADDED snapshot,
filtered by selectors, ended by timeoutSeconds, and 410 Expired after compaction. Each watch
stops as soon as it has seen what it waits for, and has a short timeoutSeconds otherwise."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes import client, watch

from tests.kubeapi.fixtures import eventually, raw_request


@pytest.fixture
def core(kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def events(stream, count: int) -> list[tuple[str, str]]:
    """The first `count` (type, name) events of the stream, which is then closed."""
    seen = []
    for event in stream:
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == count:
            break
    return seen


def cm(name: str, **labels) -> dict:
    return {"metadata": {"name": name, "labels": labels}}


def test_watch_from_a_resource_version_sees_only_later_events(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, cm("before"))
    listed = core.list_namespaced_config_map(kube_namespace)
    core.create_namespaced_config_map(kube_namespace, cm("after"))
    core.patch_namespaced_config_map("after", kube_namespace, {"data": {"k": "v"}})
    core.delete_namespaced_config_map("after", kube_namespace)
    stream = watch.Watch().stream(
        core.list_namespaced_config_map,
        kube_namespace,
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    )
    assert events(stream, 3) == [("ADDED", "after"), ("MODIFIED", "after"), ("DELETED", "after")]


def test_watch_without_a_resource_version_starts_with_synthetic_added(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, cm("a"))
    core.create_namespaced_config_map(kube_namespace, cm("b"))
    core.delete_namespaced_config_map("b", kube_namespace)
    stream = watch.Watch().stream(core.list_namespaced_config_map, kube_namespace, timeout_seconds=5)
    first = next(stream)
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "a")
    core.create_namespaced_config_map(kube_namespace, cm("c"))
    assert events(stream, 1) == [("ADDED", "c")]


def test_watch_event_resource_versions_increase(core, kube_namespace):
    listed = core.list_namespaced_config_map(kube_namespace)
    for name in ("a", "b", "c"):
        core.create_namespaced_config_map(kube_namespace, cm(name))
    stream = watch.Watch().stream(
        core.list_namespaced_config_map,
        kube_namespace,
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    )
    versions = []
    for event in stream:
        versions.append(int(event["object"].metadata.resource_version))
        if len(versions) == 3:
            break
    assert versions == sorted(versions) and versions[0] > int(listed.metadata.resource_version)


def test_watch_applies_selectors_and_reports_objects_leaving_and_entering_them(core, kube_namespace):
    listed = core.list_namespaced_config_map(kube_namespace)
    core.create_namespaced_config_map(kube_namespace, cm("x", role="spare"))
    core.create_namespaced_config_map(kube_namespace, cm("y", role="other"))
    core.patch_namespaced_config_map("x", kube_namespace, {"metadata": {"labels": {"role": "busy"}}})
    core.patch_namespaced_config_map("y", kube_namespace, {"metadata": {"labels": {"role": "spare"}}})
    stream = watch.Watch().stream(
        core.list_namespaced_config_map,
        kube_namespace,
        label_selector="role=spare",
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    )
    assert events(stream, 3) == [("ADDED", "x"), ("DELETED", "x"), ("ADDED", "y")]


def test_watch_with_a_field_selector_follows_one_nodes_pods(core, kube_namespace, kube_seed):
    node = f"{kube_namespace}-n0"
    kube_seed.node(node)
    listed = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}")
    kube_seed.pod("elsewhere", kube_namespace)
    kube_seed.pod("here", kube_namespace, node=node)
    stream = watch.Watch().stream(
        core.list_pod_for_all_namespaces,
        field_selector=f"spec.nodeName={node}",
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    )
    assert events(stream, 2) == [("ADDED", "here"), ("MODIFIED", "here")]  # create, then the status write


def test_watch_ends_after_timeout_seconds(core, kube_namespace):
    listed = core.list_namespaced_config_map(kube_namespace)
    started = time.monotonic()
    seen = list(
        watch.Watch().stream(
            core.list_namespaced_config_map,
            kube_namespace,
            resource_version=listed.metadata.resource_version,
            timeout_seconds=1,
        )
    )
    assert seen == [] and 0.9 < time.monotonic() - started < 5


def test_watch_flag_spellings(kube_client, kube_namespace):
    def watch_with(flag: str) -> tuple[int, list[str]]:
        status, body = raw_request(
            kube_client,
            "GET",
            f"/api/v1/namespaces/{kube_namespace}/configmaps?watch={flag}&timeoutSeconds=1&resourceVersion=0",
        )
        return status, [json.loads(line)["type"] for line in body.decode().splitlines()]

    client.CoreV1Api(kube_client).create_namespaced_config_map(kube_namespace, cm("a"))
    with ThreadPoolExecutor(3) as pool:  # three one-second watches at once
        assert list(pool.map(watch_with, ["true", "True", "1"])) == [(200, ["ADDED"])] * 3


def test_after_compaction_an_old_resource_version_is_410_and_a_relist_recovers(kube_driver, core, kube_namespace):
    listed = core.list_namespaced_config_map(kube_namespace).metadata.resource_version
    core.create_namespaced_config_map(kube_namespace, cm("a"))
    old = kube_driver.expired_resource_version(listed)
    with pytest.raises(client.ApiException) as expired:
        list(
            watch.Watch().stream(
                core.list_namespaced_config_map, kube_namespace, resource_version=old, timeout_seconds=1
            )
        )
    assert expired.value.status == 410
    relisted = core.list_namespaced_config_map(kube_namespace)
    core.create_namespaced_config_map(kube_namespace, cm("b"))
    stream = watch.Watch().stream(
        core.list_namespaced_config_map,
        kube_namespace,
        resource_version=relisted.metadata.resource_version,
        timeout_seconds=5,
    )
    assert events(stream, 1) == [("ADDED", "b")]


def test_the_error_event_is_a_410_expired_status(kube_driver, kube_client, kube_namespace):
    core = client.CoreV1Api(kube_client)
    listed = core.list_namespaced_config_map(kube_namespace).metadata.resource_version
    core.create_namespaced_config_map(kube_namespace, cm("a"))  # history moves past it
    old = kube_driver.expired_resource_version(listed)
    status, body = raw_request(
        kube_client,
        "GET",
        f"/api/v1/namespaces/{kube_namespace}/configmaps?watch=true&timeoutSeconds=1&resourceVersion={old}",
    )
    event = json.loads(body)
    assert status == 200 and event["type"] == "ERROR"
    assert (event["object"]["kind"], event["object"]["code"], event["object"]["reason"]) == ("Status", 410, "Expired")


def test_the_server_ends_open_watches_when_it_stops(kube_api, core, kube_namespace):
    seen: list[str] = []

    def follow() -> None:
        try:
            for event in watch.Watch().stream(core.list_namespaced_config_map, kube_namespace, timeout_seconds=60):
                seen.append(event["type"])
            seen.append("end")
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            seen.append(repr(e))

    follower = threading.Thread(target=follow)
    follower.start()
    core.create_namespaced_config_map(kube_namespace, cm("a"))
    eventually(lambda: seen)
    kube_api.stop()
    follower.join(5)
    assert not follower.is_alive() and seen == ["ADDED", "end"]
