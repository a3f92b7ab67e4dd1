"""One streaming request to an OpenAI-compatible server, timed chunk by chunk (aiohttp)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from pdpool.bench.datasets import BenchRequest
from pdpool.bench.stats import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + ENDPOINTS[endpoint]


def request_body(req: BenchRequest, endpoint: str, model: str, sampling: dict) -> dict:
    """The JSON body: ``sampling`` holds temperature, ignore_eos and any extra fields."""
    body: dict = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, **sampling}
    if endpoint == "chat":
        if req.messages is not None:
            body["messages"] = req.messages
        elif isinstance(req.prompt, str):
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            raise ValueError("token-id prompts need the completions endpoint")
    else:
        if req.messages is not None:
            raise ValueError("chat messages need the chat endpoint (--endpoint chat)")
        body["prompt"] = req.prompt
    return body


def _chunk_text(data: dict) -> str:
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    return choice.get("text") or ""


async def send(session: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord,
               headers: dict | None = None, count_tokens=None) -> RequestRecord:
    """Stream ``body`` to ``url`` and fill ``record``: TTFT, ITL, latency, the usage counts, or the error.
    ``count_tokens(text)`` estimates the output tokens when the server reports no usage."""
    start = time.perf_counter()
    last = start
    text_parts: list[str] = []
    usage = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return record
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data and "choices" not in data:
                    record.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    return record
                text = _chunk_text(data)
                if text:
                    now = time.perf_counter()
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    text_parts.append(text)
                if data.get("usage"):
                    usage = data["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.latency = time.perf_counter() - start
    if usage is not None:
        record.usage_reported = True
        record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)
    else:
        text = "".join(text_parts)
        record.completion_tokens = count_tokens(text) if count_tokens else len(text_parts)
    return record
