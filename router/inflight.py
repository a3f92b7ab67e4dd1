"""The router's own count of work sent to each node, updated the moment a request is routed.

Heartbeats are seconds old; a burst decided between two of them must still spread. Each routed leg takes a
``Ticket``: it counts one request in flight on its node, and its uncached prompt tokens as queued prefill work
until the node starts answering (``prefill_done``).
"""

from __future__ import annotations

from collections import defaultdict


class Ticket:
    __slots__ = ("tracker", "node_id", "tokens", "_prefilled", "_done")

    def __init__(self, tracker: "InflightTracker", node_id: str, tokens: int) -> None:
        self.tracker = tracker
        self.node_id = node_id
        self.tokens = tokens
        self._prefilled = False
        self._done = False

    def prefill_done(self) -> None:
        if not self._prefilled:
            self._prefilled = True
            self.tracker.pending_tokens[self.node_id] -= self.tokens

    def done(self) -> None:
        if not self._done:
            self.prefill_done()
            self._done = True
            self.tracker.requests[self.node_id] -= 1
            if self.tracker.gauge is not None:
                self.tracker.gauge_child(self.node_id).dec()


class InflightTracker:
    def __init__(self, ema: float = 0.1) -> None:
        self.requests: dict[str, int] = defaultdict(int)
        self.pending_tokens: dict[str, int] = defaultdict(int)
        self.avg_prompt_tokens = 0.0     # of uncached prompt work, to price a heartbeat's waiting requests
        self._ema = ema
        self.gauge = None                # pdpool_router_inflight_requests{node}, set by RouterMetrics in
        self._gauge_children: dict = {}  # multiprocess mode (one process: the scrape reads ``requests``)

    def add(self, node_id: str, uncached_tokens: int) -> Ticket:
        self.requests[node_id] += 1
        if self.gauge is not None:
            self.gauge_child(node_id).inc()
        self.pending_tokens[node_id] += uncached_tokens
        self.avg_prompt_tokens += self._ema * (uncached_tokens - self.avg_prompt_tokens)
        return Ticket(self, node_id, uncached_tokens)

    def gauge_child(self, node_id: str):
        child = self._gauge_children.get(node_id)
        if child is None:   # labels() hashes and locks on every call
            child = self._gauge_children[node_id] = self.gauge.labels(node_id)
        return child

    def total(self) -> int:
        return sum(self.requests.values())

    def queue_depth(self, endpoint) -> int:
        """Requests on the node: its heartbeat's (all routers') plus this router's own in flight. Our own are
        counted twice once a heartbeat has seen them; only the ranking between nodes matters."""
        return endpoint.load.num_waiting + endpoint.load.num_running + self.requests.get(endpoint.node_id, 0)

    def queued_prefill_tokens(self, endpoint) -> float:
        """Estimated prompt tokens waiting to be prefilled on the node."""
        return self.pending_tokens.get(endpoint.node_id, 0) + endpoint.load.num_waiting * self.avg_prompt_tokens
