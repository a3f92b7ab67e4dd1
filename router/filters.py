"""Filters: drop candidates before scoring."""

from __future__ import annotations

import logging

from pdpool.router.plugins import Context, Plugin, register

logger = logging.getLogger("pdpool.router")


@register("load-margin-filter")
class LoadMarginFilter(Plugin):
    """Prefix affinity yields to load (the lesson of llm-d's prefix-affinity filter): a node's cost for this
    request is its queued prefill tokens plus the request's own uncached tokens there (Dynamo's cost model
    likewise adds the uncached prefill blocks). When the node holding the longest prefix costs more than
    ``marginTokens`` over the cheapest node, every node that far above the cheapest one is dropped, and the
    prefix stops pinning the burst to it. Counting the request's own tokens keeps a hit from being sent where it
    would prefill its whole prompt again for a smaller queue."""

    def __init__(self, marginTokens: int = 2048) -> None:
        super().__init__(marginTokens=marginTokens)
        self.margin = marginTokens

    def filter(self, ctx: Context, endpoints: list) -> list:
        if len(endpoints) < 2:
            return endpoints
        load = {e.node_id: ctx.inflight.queued_prefill_tokens(e) + ctx.uncached_tokens(e.node_id)
                for e in endpoints}
        least = min(load.values())
        best = max(endpoints, key=lambda e: ctx.matched_blocks.get(e.node_id, 0))
        if ctx.matched_blocks.get(best.node_id, 0) == 0 or load[best.node_id] - least <= self.margin:
            return endpoints
        ctx.events.append("affinity_yield")
        return [e for e in endpoints if load[e.node_id] - least <= self.margin]
