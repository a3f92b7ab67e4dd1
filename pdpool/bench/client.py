"""One streaming request to an OpenAI-compatible server, timed chunk by chunk (aiohttp)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from pdpool.bench.datasets import BenchRequest, is_int
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
    """The generated text of one chunk; ``ValueError`` when the chunk is not shaped as OpenAI's."""
    choices = data.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError("a stream chunk's choices is not a list")
    if not choices:
        return ""
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ValueError("a stream chunk's choice is not an object")
    if "delta" in choice:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError("a stream chunk's delta is not an object")
        parts = (delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning"))
    else:
        parts = (choice.get("text"),)
    if not all(part is None or isinstance(part, str) for part in parts):
        raise ValueError("a stream chunk's text is not a string")
    return "".join(part or "" for part in parts)


def _token_count(counts: dict, key: str) -> int | None:
    value = counts.get(key)
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise ValueError(f"usage.{key} is not a count: {value!r}")
    return value


def _read_usage(record: RequestRecord, usage) -> bool:
    """Fill the record's counts from ``usage``; False when it has no ``completion_tokens`` (counted locally then)."""
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens_details") or {}, dict):
        raise ValueError(f"usage is not an object of counts: {json.dumps(usage)[:200]}")
    prompt, completion = _token_count(usage, "prompt_tokens"), _token_count(usage, "completion_tokens")
    record.prompt_tokens = record.prompt_tokens if prompt is None else prompt
    if completion is None:
        return False
    record.usage_reported = True
    record.completion_tokens = completion
    record.cached_tokens = _token_count(usage.get("prompt_tokens_details") or {}, "cached_tokens") or 0
    return True


async def send(session: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord,
               headers: dict | None = None, count_tokens=None) -> RequestRecord:
    """Stream ``body`` to ``url`` and fill ``record``: TTFT, ITL, latency, the usage counts, or the error.
    ``count_tokens(text)`` estimates the output tokens when the server reports no usage. A request succeeds only
    when its stream ends with ``data: [DONE]``; a chunk not shaped as OpenAI's is the request's error."""
    start = time.perf_counter()
    last = start
    text_parts: list[str] = []
    usage = None
    events = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:300]}"
                return record
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                events += 1
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if not isinstance(data, dict):
                    raise ValueError(f"a stream chunk is not a JSON object: {payload[:200]!r}")
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
            else:
                streamed = events or resp.content_type == "text/event-stream"
                record.error = ("the stream ended before data: [DONE]" if streamed else
                                f"no event stream in the response (Content-Type {resp.content_type})")
                return record
        record.latency = time.perf_counter() - start
        counted = usage is not None and _read_usage(record, usage)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: JSON, shape, line size
        detail = str(exc)
        if not detail and isinstance(exc, asyncio.TimeoutError) and session.timeout.total is not None:
            detail = f"no complete response within --request-timeout ({session.timeout.total:g} s)"
        record.error = f"{type(exc).__name__}: {detail}"[:300]
        record.latency = None
        return record
    if not counted:
        text = "".join(text_parts)
        record.completion_tokens = count_tokens(text) if count_tokens else len(text_parts)
    return record
