"""The prefill role's internal endpoints (internal token required):

* ``POST /internal/kv/leases/{lease_id}/notify``: the decode node finished pulling (or gave up). Answers
  ``{"held": bool}``: whether the lease was still held when the notification arrived. The blocks are freed.
* ``POST /internal/kv/leases/renew``: body ``{"lease_ids": [...]}``, the decode node still queues these handoffs.
  Answers ``{"renewed": {lease_id: seconds}}`` for the leases still held (a full duration again, less the handle's
  safety margin); a lease missing from it is gone.
* ``POST /internal/kv/responses/{request_id}/release``: the router's client left while this response (its
  ``X-Request-Id``) was prefilling, and its handle may have been written but not read: frees its leases, if any.
  Answers ``{"released": n}``.
* ``POST /internal/kv/leases/{lease_id}/push``: push mode. Body ``{"agent_metadata": b64, "block_ids":
  [decode's block ids], "remote_block_ids": [this node's]}``; WRITEs the blocks into the decode node, then
  ends the lease as a notification would, and answers ``{"held": bool}``.
"""

from __future__ import annotations

import asyncio
import base64
import logging

from aiohttp import web

from pdpool import internal_api
from pdpool.kv_transfer.agent import KVTransferError, unpack_metadata
from pdpool.server import json_body
from pdpool.server.errors import APIError

logger = logging.getLogger(__name__)


def lease_routes(node, token: str | None) -> list[web.RouteDef]:
    """The routes of a prefill node (``pdpool.node.Node``: ``require_llm()`` is a 503 until loaded; ``prefill``
    and ``worker`` are its prefill side and NIXL worker)."""

    async def notify(request: web.Request) -> web.Response:
        internal_api.check(request, token)
        held = await node.require_llm().call(node.prefill.notify, request.match_info["lease_id"],
                                             _binding(await request.read()))
        return web.json_response({"held": held})

    async def renew(request: web.Request) -> web.Response:
        internal_api.check(request, token)
        lease_ids = json_body.read_json_body(await request.read()).get("lease_ids")
        if not isinstance(lease_ids, list) or not all(isinstance(i, str) for i in lease_ids):
            raise APIError("renew: lease_ids must be a list of lease ids")
        renewed = await node.require_llm().call(node.prefill.renew, lease_ids)
        return web.json_response({"renewed": renewed})

    async def release_response(request: web.Request) -> web.Response:
        internal_api.check(request, token)
        released = await node.require_llm().call(node.prefill.release_response, request.match_info["request_id"])
        return web.json_response({"released": released})

    async def push(request: web.Request) -> web.Response:
        internal_api.check(request, token)
        lease_id = request.match_info["lease_id"]
        body = json_body.read_json_body(await request.read())
        llm, side, worker = node.require_llm(), node.prefill, node.worker
        dst, src = body.get("block_ids"), body.get("remote_block_ids")
        if (not isinstance(dst, list) or not isinstance(src, list) or len(dst) != len(src)
                or not all(type(b) is int and b >= 0 for b in dst + src)):
            raise APIError("push: block_ids and remote_block_ids must be lists of block ids of equal length")
        binding = _binding_of(body)
        held_blocks = await llm.call(side.lease_blocks, lease_id, binding)
        if held_blocks is None:
            await llm.call(side.notify, lease_id)
            return web.json_response({"held": False, "reason": "lease expired, unknown or not this handle's"})
        if not set(src) <= set(held_blocks):
            raise APIError("push: remote_block_ids are not the lease's blocks")
        try:
            metadata = base64.b64decode(body["agent_metadata"], validate=True)
            with worker.agent.using(unpack_metadata(metadata)[0]):  # the peer sweep leaves it loaded meanwhile
                peer = await asyncio.get_running_loop().run_in_executor(None, worker.add_peer, metadata)  # off loop
                await worker.push(peer, dst, src)
        except (KVTransferError, KeyError, ValueError) as exc:
            await llm.call(side.notify, lease_id)
            return web.json_response({"held": False, "reason": f"push failed: {exc}"}, status=502)
        held = await llm.call(side.notify, lease_id, binding)
        return web.json_response({"held": held})

    return [web.post("/internal/kv/leases/renew", renew),
            web.post("/internal/kv/leases/{lease_id}/notify", notify),
            web.post("/internal/kv/leases/{lease_id}/push", push),
            web.post("/internal/kv/responses/{request_id}/release", release_response)]


def _binding(raw: bytes) -> str | None:
    """A notification's ``binding`` (``KVHandle.binding()`` of the handle its sender read by); None for a plain
    release (``{"release": true}``, an empty or unreadable body), which frees the lease all the same."""
    try:
        return _binding_of(json_body.read_json_body(raw)) if raw else None
    except APIError:
        return None


def _binding_of(body: dict) -> str | None:
    binding = body.get("binding")
    return binding if isinstance(binding, str) else None
