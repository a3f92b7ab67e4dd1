"""Pickers: rank scored candidates, best first (the rest are the retry order)."""

from __future__ import annotations

import itertools
import random
from random import random as _random

from pdpool.router.plugins import Context, Plugin, register


@register("max-score-picker")
class MaxScorePicker(Plugin):
    """Highest total score first; ties broken at random, so equal nodes share a burst."""

    def rank(self, ctx: Context, scored: list[tuple[object, float]]) -> list:
        # A random second key: equal scores come in a uniformly random order (random.sample's Python loop costs
        # more than the rest of the ranking of a few nodes).
        return [e for e, _ in sorted(scored, key=lambda es: (-es[1], _random()))]


@register("round-robin-picker")
class RoundRobinPicker(Plugin):
    """Ignores scores: each role's candidates in turn (a baseline for benchmarks)."""

    def __init__(self) -> None:
        super().__init__()
        self._counters: dict[str, itertools.count] = {}

    def rank(self, ctx: Context, scored: list[tuple[object, float]]) -> list:
        eps = sorted((e for e, _ in scored), key=lambda e: e.node_id)
        i = next(self._counters.setdefault(ctx.role, itertools.count())) % len(eps)
        return eps[i:] + eps[:i]


@register("random-picker")
class RandomPicker(Plugin):
    """Ignores scores: a uniformly random order (a baseline)."""

    def rank(self, ctx: Context, scored: list[tuple[object, float]]) -> list:
        return random.sample([e for e, _ in scored], len(scored))
