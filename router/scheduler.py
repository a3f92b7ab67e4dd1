"""One routing decision: decode node first, then (maybe) a prefill node.

    candidates (ready, not cooling down, fingerprint ok)
      -> prefix lookup, once for both roles (precise or approximate)
      -> decode: filters -> weighted scorers -> picker   => ranked decode nodes (the tail: retry order)
      -> uncached prompt tokens on the chosen decode node >= disagg_min_tokens, a prefill node usable and the
         request a single prompt with n == 1  => prefill: filters -> scorers -> picker; else decode-only
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdpool.block_hash import ModelFingerprint
from pdpool.router.endpoints import Endpoint, Pool
from pdpool.router.inflight import InflightTracker
from pdpool.router.plugins import Context
from pdpool.router.prefix_index import PrefixIndex
from pdpool.router.settings import SchedulerProfile

logger = logging.getLogger("pdpool.router")


class NoNodeError(RuntimeError):
    """No ready node can take the request (the API's 503)."""


@dataclass
class RoutePlan:
    decode: list[Endpoint]                  # best first; the rest are retries
    prefill: Endpoint | None
    matched_blocks: dict[str, int]
    block_hashes: list = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Scheduler:
    def __init__(self, pool: Pool, index: PrefixIndex, inflight: InflightTracker, profile: SchedulerProfile, *,
                 model_id: str, dtype: str, block_size: int, disagg_min_tokens: int) -> None:
        self.pool = pool
        self.index = index
        self.inflight = inflight
        self.profile = profile
        self.model_id = model_id
        self.dtype = None if dtype == "auto" else dtype
        self.block_size = block_size
        self.disagg_min_tokens = disagg_min_tokens
        self._refused: set[tuple[str, str | None]] = set()
        self._fingerprint: ModelFingerprint | None = None

    # ---- fingerprint ----------------------------------------------------------------------------------

    def fingerprint(self) -> ModelFingerprint | None:
        """The router's: served model name, dtype (``auto``: the first matching node's), block size."""
        if self.dtype is None:
            for e in self.pool.endpoints.values():
                fp = e.fingerprint
                if fp is not None and fp.model_id == self.model_id and fp.block_size == self.block_size:
                    self.dtype = fp.dtype
                    logger.info("block-hash fingerprint: dtype %s adopted from node %s", fp.dtype, e.node_id)
                    break
            else:
                return None
        fp = self._fingerprint
        if fp is None or fp.dtype != self.dtype:   # one object while the dtype stands (it is a memo key)
            fp = self._fingerprint = ModelFingerprint(self.model_id, self.dtype, self.block_size)
        return fp

    def compatible(self, e: Endpoint, fp: ModelFingerprint | None) -> bool:
        theirs = e.fingerprint
        if theirs is None or fp is None or theirs is fp or theirs == fp:
            return True
        key = (e.node_id, e.incarnation)
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("refusing node %s (%s): its block-hash fingerprint %s differs from the router's %s",
                           e.node_id, e.url, e.fingerprint, fp)
        return False

    # ---- one decision ---------------------------------------------------------------------------------

    async def plan(self, num_prompt_tokens: int, hashes_of, *, disaggregable: bool) -> RoutePlan:
        """``hashes_of(fingerprint) -> block hashes`` of the prompt (computed only when a fingerprint is known)."""
        t0 = time.perf_counter()
        fp = self.fingerprint()
        decode = [e for e in self.pool.decode_candidates() if self.compatible(e, fp)]
        if not decode:
            raise NoNodeError("no ready decode node")
        prefill = [e for e in self.pool.prefill_candidates() if self.compatible(e, fp)] if disaggregable else []
        hashes = hashes_of(fp) if fp is not None else []
        matched = await self.index.lookup(hashes, decode + prefill)
        ctx = Context("decode", num_prompt_tokens, self.block_size, matched, self.inflight)
        ranked = self._rank(ctx, decode)
        chosen_prefill = None
        # Only a decode-capable node takes a handoff: with no usable decode node, ``decode_candidates`` falls back
        # to prefill nodes, and such a node serves the request whole (it refuses kv_transfer_params).
        if prefill and ranked[0].can_decode and ranked[0].pdpool and ctx.uncached_tokens(
                ranked[0].node_id) >= max(1, self.disagg_min_tokens):
            pctx = Context("prefill", num_prompt_tokens, self.block_size, matched, self.inflight, ctx.events)
            chosen_prefill = self._rank(pctx, prefill)[0]
        return RoutePlan(ranked, chosen_prefill, matched, hashes, ctx.events, time.perf_counter() - t0)

    def _rank(self, ctx: Context, endpoints: list[Endpoint]) -> list[Endpoint]:
        kept = endpoints
        for f in self.profile.filters:
            kept = f.filter(ctx, kept) or kept
        totals = {e.node_id: 0.0 for e in kept}
        for scorer, weight in self.profile.scorers:
            for node_id, value in scorer.score(ctx, kept).items():
                totals[node_id] += weight * value
        ranked = self.profile.picker.rank(ctx, [(e, totals[e.node_id]) for e in kept])
        if len(ranked) == len(endpoints):   # nothing filtered out (the common case)
            return ranked
        dropped = [e for e in endpoints if e not in ranked]  # filtered out: still retry candidates, last
        return ranked + dropped
