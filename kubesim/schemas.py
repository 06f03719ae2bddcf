"""Schemas, applied as the API server applies them to every write: a CustomResourceDefinition's to
its custom objects (the schema's defaults first, as apiextensions-apiserver's structural defaulting
does: a missing property with a `default` gets it wherever its parent object is present; then
validation), and, when the server is started with a Kubernetes version, the built-in types' OpenAPI
schemas of that release (from the kubernetes-validate package, a test dependency). A failure is the
422 Invalid a client gets.

Not simulated: pruning of unknown fields (a real server drops them, with a warning, unless the
schema preserves them; here they are refused, which is stricter) and CEL validation rules.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator

CRD_DIR = Path(__file__).resolve().parent / "crds"


@functools.cache
def crd_schema(filename: str, version: str) -> dict[str, Any]:
    """The openAPIV3Schema of one served version of the CRD in kubesim/crds/."""
    crd = yaml.safe_load((CRD_DIR / filename).read_text())
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise KeyError(f"{filename} has no version {version}")


def fill_defaults(filename: str, version: str, obj: dict[str, Any]) -> None:
    """Fill in, in place, the defaults of the CRD's schema that `obj` lacks."""
    _default(crd_schema(filename, version), obj)


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                _default(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in (schema.get("properties") or {}):
                    _default(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


def _strict(schema: Any) -> Any:
    """The schema with additionalProperties: false wherever it lists properties and does not say
    otherwise, so that a field the schema does not know is refused rather than kept."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def _validator(filename: str, version: str) -> Draft7Validator:
    schema = _strict(crd_schema(filename, version))
    # metadata is the API server's, not the schema's, to check (the CRD says only "type: object")
    schema["properties"]["metadata"] = {"type": "object"}
    return Draft7Validator(schema)


def problems(filename: str, version: str, obj: dict[str, Any]) -> list[str]:
    """Each way `obj` breaks the schema, as the API server words a field error: path: message."""
    found = []
    for error in sorted(_validator(filename, version).iter_errors(obj), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in error.absolute_path) or "<root>"
        found.append(f"{path}: Invalid value: {error.message}")
    return found


def builtin_problems(kubernetes_version: str, obj: dict[str, Any]) -> list[str]:
    """Each way a built-in object breaks its type's schema in that Kubernetes release (unknown
    fields included)."""
    import kubernetes_validate  # only a server started with builtin_schemas needs it

    try:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path) or "<root>"
        return [f"{path}: Invalid value: {e.message}"]
    return []
