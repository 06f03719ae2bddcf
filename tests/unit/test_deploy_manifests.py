"""deploy/kubernetes: it renders, every object is a valid Kubernetes object (it survives a round
trip through the official client's models, so a misspelt field fails), the RBAC grants exactly
what backends/kubernetes/calls.py says the code calls, and the configuration is one the worker
and the hooks accept."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient

from backends.kubernetes.calls import rbac_rules
from contracts.k8s_settings import KubernetesSettings
from contracts.settings import Settings
from starter.hooks.settings import HookSettings

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def load_base() -> list[dict]:
    """The base as kustomize builds it: the listed resources, in order (it has no transformers)."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources"}, "a transformer needs kubectl kustomize here"
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str, str], dict]:
    return {_key(o): o for o in load_base()}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_builds_the_same_objects(objects):
    out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=True)
    assert {_key(o): o for o in yaml.safe_load_all(out.stdout) if o} == objects


def test_every_object_survives_the_official_models(objects):
    api = ApiClient()
    for obj in objects.values():
        version = obj["apiVersion"].rpartition("/")[2].capitalize()
        model = api.deserialize(json.dumps(obj), f"{version}{obj['kind']}", "application/json")
        assert api.sanitize_for_serialization(model) == obj, f"{_key(obj)} has fields the API does not know"


def _granted(objects, kind: str) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for (k, _, _), obj in objects.items() if k == kind
            for rule in obj["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def test_rbac_grants_exactly_what_the_code_calls(objects):
    assert _granted(objects, "ClusterRole") == rbac_rules(namespaced=False)
    assert _granted(objects, "Role") == rbac_rules(namespaced=True)


def test_the_roles_are_bound_to_the_workers_account_where_the_slurmd_pods_are(objects):
    config = objects["ConfigMap", "training-recovery", "training-recovery"]["data"]
    worker = objects["Deployment", "training-recovery", "training-recovery-worker"]["spec"]["template"]["spec"]
    account = {"kind": "ServiceAccount", "name": worker["serviceAccountName"], "namespace": "training-recovery"}
    assert ("ServiceAccount", "training-recovery", account["name"]) in objects
    for kind, namespace, name in objects:
        if kind.endswith("Binding"):
            assert objects[kind, namespace, name]["subjects"] == [account]
        if kind in ("Role", "RoleBinding"):
            assert namespace == config["RECOVERY_K8S_NAMESPACE"]


def test_the_configuration_is_accepted_by_the_worker_and_the_hooks(objects, monkeypatch, tmp_path):
    config = objects["ConfigMap", "training-recovery", "training-recovery"]["data"]
    secret = objects["Secret", "training-recovery", "training-recovery"]["stringData"]
    token = tmp_path / "hooks-token"
    token.write_text("a-token")
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RECOVERY_HOOKS_TOKEN_FILE", str(token))
    Settings()
    k8s = KubernetesSettings()
    hooks = HookSettings()
    assert k8s.enabled and k8s.nodeset_name
    assert set(secret) == {"SLURMRESTD_TOKEN", "RECOVERY_K8S_HTTP_TOKEN", "hooks-token"}
    assert all(value == "" for value in secret.values()), "the base ships no secret"

    spec = objects["Deployment", "training-recovery", "training-recovery-hooks"]["spec"]["template"]["spec"]
    service = objects["Service", "training-recovery", "training-recovery-hooks"]["spec"]
    (container,) = spec["containers"]
    assert container["ports"][0]["containerPort"] == hooks.port == service["ports"][0]["port"]
    mount = next(m for m in container["volumeMounts"] if config["RECOVERY_HOOKS_TOKEN_FILE"].startswith(m["mountPath"]))
    assert mount["readOnly"]


def test_every_container_is_probed_limited_and_unprivileged(objects):
    for (kind, _, name), obj in objects.items():
        if kind != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"], name
        for container in pod["containers"]:
            assert container.get("readinessProbe"), name
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert container["securityContext"]["readOnlyRootFilesystem"], name
