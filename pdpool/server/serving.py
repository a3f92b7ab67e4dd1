"""Run a parsed OpenAI request on the engine; build the JSON response or the SSE stream.

One request may fan out (several prompts, ``n`` > 1): each choice is its own engine request with id
``<response id>-<choice index>``. All of them are added before anything is sent, so a validation error is a
plain 400; once streaming starts, an engine error becomes a final ``{"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from pdpool import __version__
from pdpool.engine.async_llm import (AsyncLLM, EngineClosedError, EngineStepError, RequestFailedError,
                                     RequestStream)
from pdpool.engine.llm_engine import InvalidRequestError, QueueFullError, TokenLogprobs
from pdpool.engine.output_processor import RequestOutput
from pdpool.engine.sampling_params import SamplingParamsError
from pdpool.logs import HEADER as REQUEST_ID_HEADER
from pdpool.server.beam_search import BeamSearch, BeamStream
from pdpool.server.errors import APIError
from pdpool.server.protocol import GenerationRequest
from pdpool.server.tools import AutoToolStream, ToolCallStream, finish_reason, tool_message


@dataclass
class _Choice:
    index: int
    stream: RequestStream | BeamStream
    prompt_text: str | None = None      # for echo
    text_offset: int = 0                # completions logprobs: offset of the next token's text
    started: bool = False               # chat streaming: role delta sent
    final: RequestOutput | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    tool_calls: ToolCallStream | AutoToolStream | None = None   # chat streaming with tool_choice: the calls so far


def api_error(exc: BaseException) -> APIError:
    """The OpenAI error for an exception out of the engine (its text is ours, never an internal one)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError, SamplingParamsError)):
        return APIError(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, QueueFullError):
        return APIError(str(exc), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(exc, EngineClosedError):
        return APIError(str(exc), status=503, code="shutting_down")
    if isinstance(exc, (EngineStepError, RequestFailedError)):
        return APIError(str(exc), status=500, type="internal_error")
    return APIError("internal error while generating", status=500, type="internal_error")


class Generation:
    """The engine requests behind one API response. ``request_id`` (the client's ``X-Request-Id`` or a new one)
    names the response and each engine request (``<request_id>-<choice>``, made unique per response)."""

    def __init__(self, llm: AsyncLLM, req: GenerationRequest, request_id: str | None = None) -> None:
        self.llm = llm
        self.req = req
        self.request_id = request_id or uuid.uuid4().hex
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{self.request_id}"
        self._engine_prefix = f"{self.request_id}-{uuid.uuid4().hex[:8]}" if request_id else self.request_id
        self.created = int(time.time())
        self.choices: list[_Choice] = []
        self.system_fingerprint = system_fingerprint(llm.engine.fingerprint.encode())

    async def start(self) -> None:
        req = self.req
        try:
            for p_index, prompt in enumerate(req.prompts):
                token_ids = req.prompt_token_ids[p_index] if req.prompt_token_ids is not None else None
                if req.use_beam_search:   # the n choices are one search's n best beams
                    await self._start_beam_search(p_index, prompt, token_ids)
                    continue
                for j in range(req.n):
                    index = p_index * req.n + j
                    params = req.params if req.n == 1 else req.params.for_choice(j)
                    stream = await self.llm.add_request(
                        f"{self._engine_prefix}-{index}", prompt, params, priority=req.priority,
                        cache_salt=req.cache_salt, kv_transfer_params=req.kv_transfer_params,
                        add_special_tokens=req.kind != "chat", prompt_token_ids=token_ids)
                    self.choices.append(_Choice(index, stream))
        except (InvalidRequestError, SamplingParamsError, QueueFullError, EngineClosedError) as exc:
            self.abort()
            raise api_error(exc) from None
        except BaseException:
            self.abort()
            raise

    async def _start_beam_search(self, p_index: int, prompt, token_ids: list[int] | None) -> None:
        req = self.req
        search = BeamSearch(self.llm, f"{self._engine_prefix}-{p_index}", prompt, req.params, width=req.n,
                            length_penalty=req.length_penalty, priority=req.priority, cache_salt=req.cache_salt,
                            add_special_tokens=req.kind != "chat", prompt_token_ids=token_ids)
        for j, stream in enumerate(await search.start()):
            self.choices.append(_Choice(p_index * req.n + j, stream))

    def abort(self) -> None:
        for choice in self.choices:
            choice.stream.abort()

    # ---- usage -----------------------------------------------------------------------------------

    def usage(self, outputs: list[RequestOutput | None]) -> dict:
        prompt_tokens = cached = completion = 0
        seen_prompts = set()
        for choice, out in zip(self.choices, outputs):
            if out is None:
                continue
            group = choice.index // self.req.n
            if group not in seen_prompts:
                seen_prompts.add(group)
                prompt_tokens += len(out.prompt_token_ids)
                cached += out.num_cached_tokens
            completion += 0 if self.req.echo_only else out.num_output_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage


@functools.lru_cache(maxsize=4)
def system_fingerprint(model_fingerprint: bytes) -> str:
    """OpenAI's ``system_fingerprint``, in vLLM's form (``<server>-<version>-<hash>``): the pdpool version and the
    model's block-hash fingerprint (model id, dtype, block size), the same on every node of a pool."""
    return f"pdpool-{__version__}-{hashlib.sha256(model_fingerprint).hexdigest()[:8]}"


# ---- logprobs formats ----------------------------------------------------------------------------

def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _token_name(tokenizer, token_id: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or with vLLM's ``return_tokens_as_token_ids`` ``token_id:<id>`` (a
    token that is part of a UTF-8 character has no text of its own)."""
    return f"token_id:{token_id}" if as_ids else _token_str(tokenizer, token_id)


def completion_logprobs(tokenizer, entries: list[TokenLogprobs], choice: _Choice, as_ids: bool = False) -> dict:
    """``as_ids``: tokens and top_logprobs' keys as ``token_id:<id>``; ``text_offset`` stays the offset in the
    answer's text (vLLM's counts the ``token_id:<id>`` strings' lengths, which index nothing)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        s = _token_str(tokenizer, e.token_id)
        name = f"token_id:{e.token_id}" if as_ids else s
        tokens.append(name)
        token_logprobs.append(e.logprob)
        top.append(_top_with_sampled(tokenizer, name, e, as_ids))
        offsets.append(choice.text_offset)
        choice.text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(tokenizer, prompt_token_ids: list[int], entries: list, choice: _Choice, top_n: int,
                  as_ids: bool = False) -> dict:
    """An echoed prompt's part of a completion's logprobs, as vLLM gives it: its first token has no logprob and
    no top (nothing predicts it); ``entries`` is the engine's ``prompt_logprobs`` (first None), whose tops may be
    longer than the request's ``logprobs`` (``top_n``) when it also asked for vLLM's ``prompt_logprobs``."""
    first = _token_str(tokenizer, prompt_token_ids[0])
    out = {"tokens": [f"token_id:{prompt_token_ids[0]}" if as_ids else first],
           "token_logprobs": [None], "top_logprobs": [None], "text_offset": [choice.text_offset]}
    choice.text_offset += len(first)
    rest = completion_logprobs(tokenizer, [TokenLogprobs(e.token_id, e.logprob, e.top[:top_n] if e.top else None)
                                           for e in entries[1:]], choice, as_ids)
    for key, values in out.items():
        values += rest[key]
    return out


def vllm_prompt_logprobs(tokenizer, entries: list, top_n: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself (its rank in the vocabulary) and the ``top_n`` best (ranks 1..)."""
    out: list = [None]
    for e in entries[1:]:
        d = {e.token_id: {"logprob": e.logprob, "rank": e.rank, "decoded_token": _token_str(tokenizer, e.token_id)}}
        for rank, (t, lp) in enumerate((e.top or [])[:top_n], start=1):
            d.setdefault(t, {"logprob": lp, "rank": rank, "decoded_token": _token_str(tokenizer, t)})
        out.append(d)
    return out


def _joined(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def _top_with_sampled(tokenizer, sampled: str, e: TokenLogprobs, as_ids: bool = False) -> dict[str, float]:
    """One position's ``top_logprobs`` as vLLM (and OpenAI's legacy completions) give it: the sampled token, then
    the top N (N + 1 entries when the sampled one is not among them; with ``logprobs=0``, the sampled one alone).
    Two ids that decode to the same text keep the first's value."""
    top = {sampled: e.logprob}
    for t, lp in e.top or ():
        top.setdefault(_token_name(tokenizer, t, as_ids), lp)
    return top


def chat_logprobs(tokenizer, entries: list[TokenLogprobs], as_ids: bool = False) -> dict:
    """``as_ids``: each ``token`` as ``token_id:<id>``, as vLLM names them; the sampled token's ``bytes`` stay its
    text's, a top entry's are its name's (vLLM's, both)."""
    def item(token_id: int, lp: float) -> dict:
        s = _token_name(tokenizer, token_id, as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for e in entries:
        d = item(e.token_id, e.logprob)
        if as_ids:
            d["bytes"] = list(_token_str(tokenizer, e.token_id).encode("utf-8"))
        d["top_logprobs"] = [item(t, lp) for t, lp in (e.top or [])]
        content.append(d)
    return {"content": content}


# ---- non-streaming -------------------------------------------------------------------------------

async def _collect(choice: _Choice) -> None:
    prompt_logprobs = None
    async for out in choice.stream:
        if out.new_logprobs:
            choice.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        choice.final = out
    if choice.final is not None and choice.final.prompt_logprobs is None:
        choice.final.prompt_logprobs = prompt_logprobs


async def full_response(gen: Generation) -> dict:
    tasks = [asyncio.ensure_future(_collect(c)) for c in gen.choices]
    try:
        await asyncio.gather(*tasks)
    except Exception as exc:  # noqa: BLE001 - one OpenAI error for the response
        raise api_error(exc) from None
    finally:
        for t in tasks:
            t.cancel()
        gen.abort()
    tokenizer = gen.llm.tokenizer
    req = gen.req
    as_ids = bool(req.return_tokens_as_token_ids)
    choices = []
    for c in gen.choices:
        out = c.final
        if req.kind == "chat":
            message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
            if req.tool_choice is not None:
                message = tool_message(req.tool_choice, out.text, cut=finish == "length")
                finish = finish_reason(req.tool_choice, finish, called="tool_calls" in message)
            message["role"] = req.response_role
            if req.chat_echo:   # vLLM's chat echo: the last message's content first (tool calls' "" or null too)
                message["content"] = req.chat_echo + (message.get("content") or "")
            choice = {"index": c.index, "message": message,
                      "logprobs": chat_logprobs(tokenizer, c.logprobs, as_ids) if req.logprobs is not None else None,
                      "finish_reason": finish, "stop_reason": out.stop_reason}
        else:
            text, generated = ("", []) if req.echo_only else (out.text, c.logprobs)
            if req.echo:
                prompt_text = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
                text = prompt_text + text
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(tokenizer, generated, c, as_ids) if not req.echo else _joined(
                    echo_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, c, req.logprobs, as_ids),
                    completion_logprobs(tokenizer, generated, c, as_ids))
            choice = {"index": c.index, "text": text, "logprobs": lp,
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if req.prompt_logprobs is not None and req.kind != "chat":
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs or [None],
                                                             req.prompt_logprobs)
        if req.return_token_ids:
            choice["token_ids"] = [] if req.echo_only else out.output_token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        choices.append(choice)
    body = {"id": gen.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": gen.created, "model": req.model, "choices": choices,
            "usage": gen.usage([c.final for c in gen.choices]), "system_fingerprint": gen.system_fingerprint}
    if req.return_token_ids and req.kind == "chat" and gen.choices:   # vLLM's place for chat (one prompt)
        body["prompt_token_ids"] = gen.choices[0].final.prompt_token_ids
    if req.prompt_logprobs is not None and req.kind == "chat" and gen.choices:   # and for its prompt_logprobs
        body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, gen.choices[0].final.prompt_logprobs or [None],
                                                       req.prompt_logprobs)
    if len(gen.choices) == 1 and gen.choices[0].final.kv_transfer_params is not None:
        body["kv_transfer_params"] = gen.choices[0].final.kv_transfer_params
    return body


# ---- streaming -----------------------------------------------------------------------------------

def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def stream_response(gen: Generation, http_request: web.Request, events=None) -> web.StreamResponse:
    """The chat or completion chunks as SSE; ``events`` (a ``stream_events.ChatStreamEvents``: the Responses or
    Messages events) turns a chat's chunks into another API's events instead."""
    req = gen.req
    tokenizer = gen.llm.tokenizer
    as_ids = bool(req.return_tokens_as_token_ids)
    # The request id header here: the app's middleware adds it only to a response not yet prepared.
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       REQUEST_ID_HEADER: gen.request_id})
    try:
        await resp.prepare(http_request)
    except BaseException:   # the client left before the headers went out: nobody will read these choices
        gen.abort()
        raise
    encode = _sse if events is None else events.sse

    async def emit(item: dict | str) -> None:
        data = encode(item)
        if data:
            await resp.write(data)

    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for out in c.stream:
                merged.put_nowait((c, out))
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            merged.put_nowait((c, exc))
        finally:
            merged.put_nowait((c, None))

    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        d = {"id": gen.id, "object": obj, "created": gen.created, "model": req.model, "choices": choices}
        if req.include_usage:
            d["usage"] = usage
        return d

    def choice_usage(out: RequestOutput | None, prompt_tokens: int = 0) -> dict | None:
        """continuous_usage_stats: each chunk's usage is its own choice's, as vLLM's: that choice's prompt and
        its completion tokens so far (the role and echo chunks: the prompt, 0). The final chunk has the totals."""
        if not (req.include_usage and req.continuous_usage):
            return None
        if out is not None:
            prompt_tokens = len(out.prompt_token_ids)
        completion = out.num_output_tokens if out is not None and not req.echo_only else 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    tasks = [asyncio.ensure_future(pump(c)) for c in gen.choices]
    latest: dict[int, RequestOutput] = {}
    try:
        # return_token_ids: the prompt's ids come once per choice, in its first chunk (vLLM's places: the chunk's
        # top level for chat, the choice for completions); then each chunk's new ids.
        ids_sent: set[int] = set()
        if req.kind == "chat":
            for c in gen.choices:  # role first, as OpenAI does
                first = chunk([{"index": c.index, "delta": {"role": req.response_role, "content": ""},
                                "logprobs": None, "finish_reason": None}],
                              choice_usage(None, len(c.stream.prompt_token_ids)))
                if req.return_token_ids:
                    first["prompt_token_ids"] = c.stream.prompt_token_ids
                await emit(first)
            if req.chat_echo:   # vLLM's chat echo: each choice's next chunk is the echoed message
                for c in gen.choices:
                    await emit(chunk([{"index": c.index, "delta": {"content": req.chat_echo},
                                       "logprobs": None, "finish_reason": None}],
                                     choice_usage(None, len(c.stream.prompt_token_ids))))
        def echo_chunk(c: _Choice, prompt_logprobs: list | None) -> dict:
            prompt = req.prompts[c.index // req.n]
            if c.stream.prompt_cut:   # truncate_prompt_tokens cut it: what the engine kept, as a whole answer gives
                prompt = c.stream.prompt_token_ids
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            lp = (echo_logprobs(tokenizer, c.stream.prompt_token_ids, prompt_logprobs, c, req.logprobs, as_ids)
                  if prompt_logprobs else None)
            choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None, "stop_reason": None}
            if req.return_token_ids:
                choice["prompt_token_ids"] = c.stream.prompt_token_ids
                ids_sent.add(c.index)
            return chunk([choice], choice_usage(None, len(c.stream.prompt_token_ids)))

        # echo: the prompt first; with logprobs, once the engine has them (with the first token), as vLLM does
        echo_late = req.echo and req.logprobs is not None
        if req.echo and not echo_late:
            for c in gen.choices:
                await emit(echo_chunk(c, None))
        pending = len(tasks)
        while pending:
            c, out = await merged.get()
            if out is None:
                pending -= 1
                continue
            if isinstance(out, BaseException):
                await emit(api_error(out).body())
                continue
            latest[c.index] = out
            if echo_late and out.prompt_logprobs is not None:
                await emit(echo_chunk(c, out.prompt_logprobs))
            if req.echo_only:         # nothing generated goes out: the final chunk, empty, says why it ended
                if not out.finished:
                    continue
                out = dataclasses.replace(out, new_text="", new_logprobs=[], new_token_ids=[])
            tool_deltas = auto_delta = None
            if req.tool_choice is not None and req.tool_choice.parser is not None:   # "auto": content and calls
                if c.tool_calls is None:
                    c.tool_calls = AutoToolStream(req.tool_choice)
                auto_delta = c.tool_calls.feed(out.new_text, out.finished)
            elif req.tool_choice is not None:
                if c.tool_calls is None:
                    c.tool_calls = ToolCallStream(req.tool_choice)
                tool_deltas = c.tool_calls.feed(out.new_text)
                if out.finished and not tool_deltas and req.tool_choice.name is not None and c.tool_calls.sent:
                    tool_deltas = [{"index": 0, "function": {"arguments": ""}}]   # vLLM's last chunk of a call
            fresh = out.new_text if auto_delta is None else auto_delta.get("content") or auto_delta.get("tool_calls")
            if not ((fresh if tool_deltas is None else tool_deltas) or out.finished or out.new_logprobs
                    or (req.return_token_ids and out.new_token_ids)
                    or (req.prompt_logprobs is not None and out.prompt_logprobs is not None)):
                continue
            lp = None
            if req.logprobs is not None and out.new_logprobs is not None:
                lp = (chat_logprobs(tokenizer, out.new_logprobs, as_ids) if req.kind == "chat"
                      else completion_logprobs(tokenizer, out.new_logprobs, c, as_ids))
            # Every content chunk has delta.content, the last one too ("" when a stop string ended the text), as
            # vLLM's; a completion chunk has stop_reason, null until the last, as vLLM's (chat: on the last only).
            if req.kind == "chat":
                choice = {"index": c.index, "delta": {"content": out.new_text}, "logprobs": lp,
                          "finish_reason": out.finish_reason if out.finished else None}
                if tool_deltas is not None:   # tool calls: their deltas in place of text (none yet: {})
                    choice["delta"] = {"tool_calls": tool_deltas} if tool_deltas else {}
                    choice["finish_reason"] = finish_reason(req.tool_choice, choice["finish_reason"])
                elif auto_delta is not None:   # "auto": the parser's content and complete calls
                    choice["delta"] = auto_delta
                    choice["finish_reason"] = finish_reason(req.tool_choice, choice["finish_reason"],
                                                            c.tool_calls.called)
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
            else:
                choice = {"index": c.index, "text": out.new_text, "logprobs": lp,
                          "finish_reason": out.finish_reason if out.finished else None,
                          "stop_reason": out.stop_reason if out.finished else None}
            if req.return_token_ids:
                if req.kind != "chat" and c.index not in ids_sent:
                    ids_sent.add(c.index)
                    choice["prompt_token_ids"] = out.prompt_token_ids
                choice["token_ids"] = out.new_token_ids
            data = chunk([choice], choice_usage(out))
            # vLLM's place for it: each choice's last chunk, or only the usage chunk when there is one. Here each
            # choice's last chunk always has it too: a router asks a node for the usage chunk to read the realized
            # prefix hits and keeps it from a client that did not ask, which would have had it nowhere.
            if out.finished:
                data["system_fingerprint"] = gen.system_fingerprint
            if req.prompt_logprobs is not None and out.prompt_logprobs is not None:   # with the first token
                plp = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs, req.prompt_logprobs)
                if req.kind == "chat":
                    data["prompt_logprobs"] = plp
                else:
                    choice["prompt_logprobs"] = plp
            await emit(data)
        if req.include_usage:
            final = chunk([], gen.usage([latest.get(x.index) for x in gen.choices]))
            final["system_fingerprint"] = gen.system_fingerprint
            await emit(final)
        await emit("[DONE]")
        await resp.write_eof()
    finally:
        for t in tasks:
            t.cancel()
        gen.abort()
    return resp
