"""Label selectors (`a=b,c!=d,e in (x,y),f notin (z),g,!h`) and field selectors (`metadata.name=x`)."""

from __future__ import annotations

import re

from .errors import ApiError

_SET = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(in|notin)\s*\(([^)]*)\)|(==|=|!=)\s*([\w./-]*))?\s*$")


def _split(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p for p in parts + [current] if p.strip()]


def label_matcher(selector: str | None):
    if not selector:
        return lambda labels: True
    requirements = []
    for part in _split(selector):
        m = _SET.match(part)
        if not m:
            raise ApiError(400, f"unable to parse requirement: {part!r}")
        negated, key, set_op, values, op, value = m.groups()
        if set_op:
            requirements.append((key, set_op, {v.strip() for v in values.split(",") if v.strip()}))
        elif op:
            requirements.append((key, "!=" if op == "!=" else "=", value))
        else:
            requirements.append((key, "!exists" if negated else "exists", None))

    def matches(labels: dict) -> bool:
        labels = labels or {}
        for key, op, arg in requirements:
            present, value = key in labels, labels.get(key)
            if ((op == "=" and value != arg) or (op == "!=" and present and value == arg)
                    or (op == "in" and value not in arg) or (op == "notin" and present and value in arg)
                    or (op == "exists" and not present) or (op == "!exists" and present)):
                return False
        return True

    return matches


def _field(obj: dict, path: str):
    value = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_matcher(selector: str | None):
    if not selector:
        return lambda obj: True
    requirements = []
    for part in _split(selector):
        m = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not m:
            raise ApiError(400, f"invalid field selector: {part!r}")
        requirements.append(m.groups())

    def matches(obj: dict) -> bool:
        return all((_field(obj, path) == value) == (op != "!=") for path, op, value in requirements)

    return matches
