"""Nodes named on the command line (``--prefill``, ``--decode``, ``--both``): probed for readiness, load and
whether they are pdpool nodes (``/v1/models`` ``owned_by == "pdpool"``); plain OpenAI servers get requests
unchanged."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from pdpool.router.endpoints import Endpoint, Load, Pool

logger = logging.getLogger("pdpool.router")


_LOAD_METRICS = {"vllm:num_requests_waiting": "num_waiting", "vllm:num_requests_running": "num_running",
                 "pdpool_kv_cache_free_blocks": "num_free_blocks", "vllm:kv_cache_usage_perc": "kv_usage",
                 "vllm:gpu_cache_usage_perc": "kv_usage"}


def parse_load(text: str) -> Load:
    """The few gauges the router needs, from Prometheus text (no full parse on the hot path). A pdpool node's are
    unlabeled; vLLM's carry labels (``vllm:num_requests_running{engine="0",model_name="m"} 1.0``), one sample per
    engine where it runs data-parallel: counts are summed over a gauge's samples, KV usage averaged."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find(" ")
        brace = line.find("{", 0, end if end >= 0 else len(line))
        name = line[:brace] if brace >= 0 else line[:end]
        attr = _LOAD_METRICS.get(name)
        if attr:
            rest = line[line.rfind("}") + 1:] if brace >= 0 else line[end:]
            try:
                v = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
            totals.setdefault(attr, []).append(v)
    load = Load()
    for attr, values in totals.items():
        setattr(load, attr, sum(values) / len(values) if attr == "kv_usage" else int(sum(values)))
    return load


class StaticDiscovery:
    def __init__(self, urls: dict[str, list[str]], pool: Pool, session: aiohttp.ClientSession, period: float,
                 probe_timeout: float = 2.0) -> None:
        self.pool = pool
        self.session = session
        self.period = period
        self.timeout = aiohttp.ClientTimeout(total=probe_timeout)
        self.endpoints = [Endpoint(node_id=u.rstrip("/"), url=u.rstrip("/"), role=role, ready=False)
                          for role, us in urls.items() for u in us]

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self.session.get(url, timeout=self.timeout) as resp:
            return resp.status, await resp.read()

    async def probe(self, e: Endpoint) -> None:
        try:
            status, _ = await self._get(e.url + "/health/ready")
            if status == 404:
                status, _ = await self._get(e.url + "/v1/models")
            ready = status == 200
            if ready and e.pdpool is None:
                status, body = await self._get(e.url + "/v1/models")
                if status == 200:

                    cards = json.loads(body).get("data") or [{}]
                    e.pdpool = cards[0].get("owned_by") == "pdpool"
                    e.max_model_len = cards[0].get("max_model_len")
            if ready:
                status, body = await self._get(e.url + "/metrics")
                if status == 200:
                    e.load = parse_load(body.decode(errors="replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            ready = False
        if ready != e.ready:   # once per change: probes run every --discovery-seconds
            logger.info("%s node %s is %s", e.role, e.url, "ready" if ready else "not ready")
            if e.role == "prefill" and ready and e.pdpool is False:
                logger.warning("prefill node %s is not a pdpool node; it cannot hand off KV", e.url)
        e.ready = ready

    async def refresh(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.endpoints))
        self.pool.replace("static", list(self.endpoints))

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001
                logger.exception("static discovery failed")
            await asyncio.sleep(self.period)
