"""Scheduling plugins: filters, scorers and pickers, registered by type name and configured in YAML.

A filter drops candidates (``filter(ctx, endpoints) -> endpoints``). A scorer returns a value in [0, 1] per
candidate (``score(ctx, endpoints) -> {node_id: value}``); the scheduler sums ``weight * value``. A picker
ranks the scored candidates (``rank(ctx, scored) -> endpoints``, best first; the rest are the retry order).
Producers compute, scorers read: the prefix match is looked up once per request and put in the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdpool.router.inflight import InflightTracker

REGISTRY: dict[str, type] = {}


def register(type_name: str):
    def deco(cls):
        cls.type_name = type_name
        REGISTRY[type_name] = cls
        return cls
    return deco


@dataclass
class Context:
    """What one decision reads: the prompt's size, the prefix match per node, the router's in-flight work."""
    role: str                                  # the role being picked: decode | prefill
    num_prompt_tokens: int
    block_size: int
    matched_blocks: dict[str, int]             # node_id -> leading blocks it holds
    inflight: InflightTracker
    events: list[str] = field(default_factory=list)   # what a plugin did worth a metric (e.g. "affinity_yield")

    @property
    def num_prompt_blocks(self) -> int:
        return self.num_prompt_tokens // self.block_size

    def uncached_tokens(self, node_id: str) -> int:
        return max(0, self.num_prompt_tokens - self.matched_blocks.get(node_id, 0) * self.block_size)


class Plugin:
    type_name = ""

    def __init__(self, **parameters: Any) -> None:
        self.parameters = parameters


def build(spec: dict, defaults: dict | None = None) -> Plugin:
    """A plugin from ``{"type": name, "parameters": {...}}``."""
    type_name = spec.get("type")
    if type_name not in REGISTRY:
        raise ValueError(f"unknown scheduling plugin {type_name!r}; known: {sorted(REGISTRY)}")
    params = {**(defaults or {}), **(spec.get("parameters") or {})}
    try:
        return REGISTRY[type_name](**params)
    except TypeError as exc:
        raise ValueError(f"plugin {type_name}: bad parameters {params}: {exc}") from None
