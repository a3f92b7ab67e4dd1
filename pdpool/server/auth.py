"""The client API key, checked the same way by a node and by the router."""

from __future__ import annotations

import hmac

from pdpool.server.errors import APIError


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that presents ``api_key`` (none without a key): the router presents its own key to its nodes,
    which a pool gives the same key (``PDPOOL_API_KEY``)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check_api_key(headers, api_key: str | None) -> None:
    """Raise a 401 (OpenAI error) unless ``headers`` present ``api_key`` (``Authorization: Bearer`` or
    ``x-api-key``); no key configured: nothing to check."""
    if not api_key:
        return
    header = headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else headers.get("x-api-key", "")
    # surrogateescape: a header's bytes that are no UTF-8 come as lone surrogates (aiohttp), a wrong key, not a 500
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), api_key.encode()):
        raise APIError("Invalid or missing API key (Authorization: Bearer <key>).", status=401,
                       code="invalid_api_key")
