"""Label and field selectors, as list and watch apply them (and as a PDB selects its pods).

Label selectors: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, comma-joined.
Field selectors: `dotted.path=v`, `==`, `!=`, comma-joined, on any path of the object (a real
apiserver allows only a few fields per type, such as spec.nodeName, metadata.name and
spec.unschedulable, and answers 400 for the others). A missing field compares as "" except the
booleans the apiserver prints as "false".
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class SelectorError(ValueError):
    pass


_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_REQUIREMENT = re.compile(
    rf"""\s*(?:
        !\s*(?P<absent>{_KEY})
      | (?P<key>{_KEY})\s*(?:
            (?P<op>==|=|!=)\s*(?P<value>{_VALUE})
          | \s(?P<setop>in|notin)\s*\((?P<values>[^()]*)\)
        )?
    )\s*$""",
    re.X,
)
_FIELD = re.compile(r"\s*(?P<path>[A-Za-z0-9_.]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^,]*?)\s*$")
# Booleans the apiserver's field sets print from a Go zero value when the field is absent.
_FIELD_DEFAULTS = {"spec.unschedulable": "false", "spec.hostNetwork": "false"}


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "in", "notin", "exists", "absent"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "absent":
            return self.key not in labels
        found = self.key in labels and labels[self.key] in self.values
        return found if self.op == "in" else not found


def _split_outside_parens(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_labels(text: str | None) -> list[Requirement]:
    """A labelSelector query parameter; raises SelectorError on anything the apiserver rejects."""
    if not text or not text.strip():
        return []
    requirements = []
    for part in _split_outside_parens(text):
        m = _REQUIREMENT.fullmatch(part)
        if not m:
            raise SelectorError(f"unable to parse requirement: {part.strip()!r}")
        if m["absent"]:
            requirements.append(Requirement(m["absent"], "absent"))
        elif m["op"]:
            requirements.append(Requirement(m["key"], "notin" if m["op"] == "!=" else "in", frozenset([m["value"]])))
        elif m["setop"]:
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            requirements.append(Requirement(m["key"], m["setop"], values))
        else:
            requirements.append(Requirement(m["key"], "exists"))
    return requirements


def from_label_selector(selector: dict) -> list[Requirement]:
    """A metav1.LabelSelector object (matchLabels and matchExpressions), as in a PDB's spec."""
    requirements = [Requirement(k, "in", frozenset([v])) for k, v in (selector.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "absent"}
    for expr in selector.get("matchExpressions") or []:
        if expr.get("operator") not in ops:
            raise SelectorError(f"{expr.get('operator')!r} is not a valid label selector operator")
        requirements.append(Requirement(expr["key"], ops[expr["operator"]], frozenset(expr.get("values") or [])))
    return requirements


def labels_match(requirements: list[Requirement], obj: dict) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in requirements)


def parse_fields(text: str | None) -> list[tuple[str, bool, str]]:
    """A fieldSelector query parameter, as (dotted path, equal?, value) terms."""
    if not text or not text.strip():
        return []
    terms = []
    for part in text.split(","):
        m = _FIELD.fullmatch(part)
        if not m:
            raise SelectorError(f"invalid selector: {part.strip()!r}; can't understand it")
        terms.append((m["path"], m["op"] != "!=", m["value"]))
    return terms


def field_value(obj: dict, path: str) -> str:
    value: object = obj
    for step in path.split("."):
        value = value.get(step) if isinstance(value, dict) else None
    if value is None:
        return _FIELD_DEFAULTS.get(path, "")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fields_match(terms: list[tuple[str, bool, str]], obj: dict) -> bool:
    return all((field_value(obj, path) == value) == equal for path, equal, value in terms)
