"""The three PATCH formats of the apiserver (server-side apply is not served).

- strategic merge (application/strategic-merge-patch+json): maps merge recursively, `null`
  deletes a key, lists are replaced unless the type declares a merge key for their path
  (`status.conditions` by `type`, containers by `name`, ownerReferences by `uid`) or a set
  (finalizers); the directives `$patch: delete|replace`, `$deleteFromPrimitiveList/<field>` are
  honoured and `$setElementOrder/<field>` (ordering only) is ignored;
- JSON merge patch (application/merge-patch+json, RFC 7386): lists are always replaced;
- JSON patch (application/json-patch+json, RFC 6902): a body that is not a list is 400, an
  operation that cannot apply (a failed `test`, a missing path) is 422.
"""

from __future__ import annotations

import copy

import jsonpatch
import jsonpointer

from .resources import SET

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
CONTENT_TYPES = (JSON_PATCH, MERGE, STRATEGIC)


class PatchError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def apply(content_type: str, original: dict, patch: object, merge_keys: dict[str, str]) -> dict:
    """`original` patched by `patch` of `content_type` (one of CONTENT_TYPES); raises PatchError.
    The result shares nothing with `original` or `patch`."""
    original, patch = copy.deepcopy(original), copy.deepcopy(patch)
    if content_type == JSON_PATCH:
        if not isinstance(patch, list):
            raise PatchError(400, "json patch must be a list of operations")
        try:
            result = jsonpatch.JsonPatch(patch).apply(original)
        except jsonpatch.InvalidJsonPatch as e:
            raise PatchError(400, f"invalid json patch: {e}") from e
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise PatchError(422, f"the server rejected our request due to an error in our request: {e}") from e
    elif not isinstance(patch, dict):
        raise PatchError(400, "a merge patch must be a JSON object")
    elif content_type == MERGE:
        result = merge_patch(original, patch)
    else:
        result = strategic_merge(original, patch, merge_keys, "")
    if not isinstance(result, dict):
        raise PatchError(422, "the patched object is not a JSON object")
    return result


def merge_patch(target: object, patch: object) -> object:
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(original: object, patch: dict, keys: dict[str, str], path: str) -> dict | None:
    """Merge `patch` into the map `original` found at `path`; None means the map is deleted."""
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _without_directives(patch)
    if directive is not None:
        raise PatchError(400, f"unknown patch directive {directive!r}")
    result = dict(original) if isinstance(original, dict) else {}
    deletions = []
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions.append((key.split("/", 1)[1], value))
            continue
        if key.startswith("$"):
            raise PatchError(400, f"unsupported patch directive {key!r}")
        sub = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, keys, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and sub in keys:
            result[key] = _merge_list(result.get(key) or [], value, keys, sub)
        else:
            result[key] = _without_directives(value)
    for name, values in deletions:
        if name in result:
            result[name] = [v for v in result[name] if v not in (values or [])]
    return result


def _merge_list(original: list, patch: list, keys: dict[str, str], path: str) -> list:
    key = keys[path]
    if key == SET:
        return original + [v for v in patch if v not in original]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_without_directives(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    result = list(original)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(400, f"{path}: every element must be an object with the merge key {key!r}")
        index = next((i for i, old in enumerate(result) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is not None:
            result[index] = strategic_merge(result[index], item, keys, f"{path}[]")
        else:
            result.append(strategic_merge({}, item, keys, f"{path}[]"))
    return result


def _without_directives(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return value
