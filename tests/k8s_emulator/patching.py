"""Patch bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

Strategic merge follows the built-in schemas' `x-kubernetes-patch-strategy` and
`x-kubernetes-patch-merge-key` (containers and ports merge by name, finalizers as a set),
and understands the directives kubectl sends: `$patch`, `$retainKeys`, `$setElementOrder/`
and `$deleteFromPrimitiveList/`.
"""

from __future__ import annotations

import copy

import jsonpatch

from .errors import ApiError

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict, operations) -> dict:
    if not isinstance(operations, list):
        raise ApiError(400, "a JSON patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(target, operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
        raise ApiError(422, f"the JSON patch could not be applied: {e}") from e


def _field_schema(schema: dict, key: str, resolve) -> dict:
    schema = resolve(schema) if schema else {}
    props = schema.get("properties") or {}
    if key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def strategic_merge(original, patch, schema: dict, resolve):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(original) if isinstance(original, dict) else {}
    orders = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name) or [] if x not in value]
            continue
        sub = resolve(_field_schema(schema, key, resolve)) if schema else {}
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and "merge" in str(sub.get("x-kubernetes-patch-strategy", "")):
            items = sub.get("items") or {}
            result[key] = _merge_list(result.get(key) or [], value, sub.get("x-kubernetes-patch-merge-key"),
                                      items, resolve)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, sub, resolve)
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    if "$retainKeys" in patch:
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    for name, order in orders.items():
        if isinstance(result.get(name), list):
            result[name] = _reorder(result[name], order)
    return result


def _merge_list(current: list, patch: list, merge_key: str | None, item_schema: dict, resolve) -> list:
    if merge_key is None:  # a set of scalars, such as finalizers
        return current + [x for x in patch if x not in current]
    result = [copy.deepcopy(x) for x in current]
    for item in patch:
        if not isinstance(item, dict):
            continue
        index = next((i for i, x in enumerate(result) if isinstance(x, dict)
                      and x.get(merge_key) == item.get(merge_key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge({}, item, item_schema, resolve))
        else:
            result[index] = strategic_merge(result[index], item, item_schema, resolve)
    return result


def _reorder(items: list, order: list) -> list:
    """`$setElementOrder`: entries are merge-key dicts (`{"name": "a"}`) or scalars; others go last."""
    if order and all(isinstance(o, dict) and len(o) == 1 for o in order):
        key = next(iter(order[0]))
        rank = {o.get(key): i for i, o in enumerate(order)}
        return sorted(items, key=lambda x: rank.get(x.get(key) if isinstance(x, dict) else None, len(rank)))
    rank = {o: i for i, o in enumerate(order) if not isinstance(o, (dict, list))}
    return sorted(items, key=lambda x: rank.get(x, len(rank)) if not isinstance(x, (dict, list)) else len(rank))
