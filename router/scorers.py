"""Scorers: a value in [0, 1] per candidate, higher is better; weights live in the configuration."""

from __future__ import annotations

from pdpool.router.plugins import Context, Plugin, register


@register("prefix-cache-scorer")
class PrefixCacheScorer(Plugin):
    """Matched leading blocks / prompt blocks, from the index lookup made once per request."""

    def score(self, ctx: Context, endpoints: list) -> dict[str, float]:
        total = ctx.num_prompt_blocks
        if total == 0:
            return {e.node_id: 0.0 for e in endpoints}
        return {e.node_id: min(1.0, ctx.matched_blocks.get(e.node_id, 0) / total) for e in endpoints}


@register("queue-scorer")
class QueueScorer(Plugin):
    """Fewer requests queued or running scores higher: ``1 - depth / max(maxQueue, deepest candidate)``. Below
    ``maxQueue`` the scale is absolute, so a few requests of difference do not outweigh a long prefix hit; above
    it the deepest candidate scores 0 (the load-margin filter breaks affinity under real overload).

    The default scale, 4, lets the router's own count of requests in flight spread a burst of new prefixes (one
    request more weighs 0.25 x the weight: more than the heartbeats' KV-usage noise), while a node must hold about
    four requests more before it loses a long prefix hit (prefix weight 3)."""

    def __init__(self, maxQueue: int = 4) -> None:
        super().__init__(maxQueue=maxQueue)
        self.max_queue = max(1, int(maxQueue))

    def score(self, ctx: Context, endpoints: list) -> dict[str, float]:
        depth = {e.node_id: ctx.inflight.queue_depth(e) for e in endpoints}
        scale = max(self.max_queue, max(depth.values(), default=0))
        return {n: 1.0 - d / scale for n, d in depth.items()}


@register("kv-usage-scorer")
class KVUsageScorer(Plugin):
    """Free KV cache scores higher: 1 - the heartbeat's KV usage."""

    def score(self, ctx: Context, endpoints: list) -> dict[str, float]:
        return {e.node_id: 1.0 - min(1.0, max(0.0, e.load.kv_usage)) for e in endpoints}
