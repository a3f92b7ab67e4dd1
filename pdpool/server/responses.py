"""OpenAI's Responses API (``POST /v1/responses``) on the chat path, as vLLM 0.32 serves it for a plain chat model.

A Responses body is translated into the chat completions body it means (``translate``), which the one chat front
end (``protocol.parse_chat``) validates, renders and samples; the chat answer, whole or streamed, is translated
back (``response_body``; ``pdpool.server.response_events`` for the stream). Node and router share this module: the
router routes a Responses request exactly as its chat body, and the decode node answers with a Response.

    input: "hi"                 -> messages: [{"role": "user", "content": "hi"}]
    instructions                -> a system message first
    input items                 -> messages (input_text/output_text parts joined by newlines); function_call items
                                   -> the assistant's tool_calls; function_call_output -> a tool message
    max_output_tokens           -> max_completion_tokens
    text.format                 -> response_format (json_object, json_schema)
    tools (function), tool_choice -> chat's tools and tool_choice (without tools "auto" and "none" are text, and
                                   "required" or a named function a 400 naming tool_choice, as in vLLM)
    include message.output_text.logprobs, top_logprobs -> logprobs, top_logprobs

vLLM's default store is off: ``store`` is taken and ignored, and nothing can be continued, so
``previous_response_id`` is a 400 (vLLM: 404, "not found"), and ``background`` a 400 as in vLLM. What a plain
model cannot do (built-in tools, reasoning, non-text input) is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pdpool.engine.sampling_params import short_repr
from pdpool.server.errors import APIError
from pdpool.server.protocol import (MAX_LOGPROBS, GenerationRequest, get_bool, get_int, get_str,
                                    parse_translated_chat)

# vLLM's Responses fields that mean the same in a chat body, passed on as they are
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
           "include_stop_str_in_output", "structured_outputs", "priority", "cache_salt", "kv_transfer_params",
           "chat_template_kwargs", "user", "parallel_tool_calls", "pdpool_prompt_token_ids")
# a chat error's field -> the Responses field the client sent
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "logprobs": "include", "continue_final_message": "input",
           "add_generation_prompt": "input", "stream_options": "stream"}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's accepted include values; the one that changes a plain model's answer is the logprobs one
_INCLUDE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
            "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content")
_TRUNCATION = ("auto", "disabled")
_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


@dataclass
class ResponsesTurn:
    """A Responses request as translated: the chat body it means, and what its Response echoes."""
    chat: dict
    echo: dict = field(default_factory=dict)


def translate(body: dict) -> ResponsesTurn:
    """``body`` (a Responses request) -> its chat body; every refusal a 400 naming the Responses field."""
    _refuse_unsupported(body)
    chat = {name: body[name] for name in _PASSED if name in body}
    messages = []
    instructions = get_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    if not messages:
        raise APIError("'input' must hold at least one message", param="input")
    chat["messages"] = messages
    if _continues(body["input"]):   # vLLM's: a last assistant message still in progress is continued
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    max_output_tokens = get_int(body, "max_output_tokens", None, ge=1)
    if max_output_tokens is not None:
        chat["max_completion_tokens"] = max_output_tokens
    stream = get_bool(body, "stream")
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}   # the final event's usage
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    top_logprobs = get_int(body, "top_logprobs", None, ge=0, le=MAX_LOGPROBS)
    if "message.output_text.logprobs" in _include(body):
        chat["logprobs"] = True
        chat["top_logprobs"] = top_logprobs or 0
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tools:
        chat["tools"] = tools
    if tool_choice is not None and (tools or tool_choice not in ("none", "auto")):
        chat["tool_choice"] = tool_choice   # without tools "none" and "auto" are text, the others chat's 400
    if get_str(body, "truncation", "disabled") not in _TRUNCATION:
        raise APIError(f"'truncation' must be one of {', '.join(_TRUNCATION)}", param="truncation")
    if body.get("truncation") == "auto":   # the prompt's end kept within the context, as vLLM's
        chat["truncate_prompt_tokens"] = -1
    get_bool(body, "store", True)    # taken and ignored: vLLM's default store is off
    echo = {"instructions": instructions, "metadata": _metadata(body.get("metadata")),
            "parallel_tool_calls": get_bool(body, "parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "max_tool_calls": get_int(body, "max_tool_calls", None, ge=0),
            "service_tier": _service_tier(body), "text": body.get("text"),
            "truncation": body.get("truncation") or "disabled", "user": get_str(body, "user")}
    return ResponsesTurn(chat, echo)


def parse(body: dict, parse_chat) -> tuple[ResponsesTurn, GenerationRequest]:
    """``body`` translated and parsed by ``parse_chat(chat_body) -> GenerationRequest`` (the node's or the
    router's own ``protocol.parse_chat``); a chat refusal names the Responses field the client sent."""
    turn = translate(body)
    return turn, parse_translated_chat(turn.chat, parse_chat, _PARAMS)


def _refuse_unsupported(body: dict) -> None:
    """vLLM's refusals, and what a plain (non-harmony) model cannot do: a 400 naming the field."""
    if get_bool(body, "background"):
        raise APIError("'background' is not supported: this server stores no responses (as vLLM without "
                       "VLLM_ENABLE_RESPONSES_API_STORE)", param="background")
    if body.get("previous_response_id") is not None:
        raise APIError(f"Previous response with id {short_repr(body['previous_response_id'])} not found: this "
                       "server stores no responses (as vLLM's default); send the conversation in 'input'",
                       param="previous_response_id", code="previous_response_not_found")
    for name, why in (("prompt", "prompt templates are not supported"),
                      ("conversation", "conversations need a stored state, which this server does not keep"),
                      ("previous_input_messages", "previous_input_messages is for harmony models only"),
                      ("reasoning", "reasoning is not supported: the served model is a plain chat model")):
        if body.get(name) is not None:
            raise APIError(f"'{name}': {why}", param=name)
    if get_bool(body, "enable_response_messages"):
        raise APIError("'enable_response_messages' is for harmony models only", param="enable_response_messages")


# ---- input -------------------------------------------------------------------------------------------------

def _input_messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(f"'input' must be a string or a non-empty list of input items, got {short_repr(items)}",
                       param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}] must be an object, got {short_repr(item)}", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _item_str(item, "call_id", i), "type": "function",
                    "function": {"name": _item_str(item, "name", i), "arguments": _item_str(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # calls after an answer belong to it
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _item_str(item, "call_id", i),
                             "content": output if isinstance(output, str) else _parts_text(output, i)})
        else:
            raise APIError(f"input[{i}]: input items of type {short_repr(kind)} are not supported (message, "
                           "function_call and function_call_output are)", param="input")
    return messages


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"input[{i}].role must be one of {', '.join(_ROLES)}, got {short_repr(role)}", param="input")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _parts_text(content, i)}


def _parts_text(parts, i: int) -> str:
    if not isinstance(parts, list):
        raise APIError(f"input[{i}].content must be a string or a list of text parts", param="input")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(f"input[{i}].content: only text parts (input_text, output_text) are supported, got "
                           f"{short_repr(kind)}", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _item_str(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(f"input[{i}].{name} must be a string, got {short_repr(value)}", param="input")
    return value


def _continues(items) -> bool:
    last = items[-1] if isinstance(items, list) and items else None
    return (isinstance(last, dict) and last.get("type", "message") == "message" and last.get("role") == "assistant"
            and last.get("status") in ("in_progress", "incomplete"))


# ---- the other fields ----------------------------------------------------------------------------------------

def _text_format(text) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or fmt is None:
        if isinstance(text, dict):
            return None
        raise APIError(f"'text' must be an object, got {short_repr(text)}", param="text")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise APIError("'text.format' of type json_schema needs 'schema'", param="text")
        spec = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(f"'text.format' must be of type text, json_object or json_schema, got {short_repr(fmt)}",
                   param="text")


def _include(body: dict) -> list[str]:
    include = body.get("include")
    if include is None:
        return []
    if not isinstance(include, list) or not all(isinstance(x, str) and x in _INCLUDE for x in include):
        raise APIError(f"'include' must be a list of {', '.join(_INCLUDE)}, got {short_repr(include)}",
                       param="include")
    return include


def _tools(tools) -> list[dict]:
    """Function tools in chat's shape; built-in tools (web_search, file_search, mcp, ...) are refused."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(f"'tools' must be a list, got {short_repr(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(f"tools[{i}]: only function tools are supported, got {short_repr(kind)}", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"name\": "
                   f"...}}, got {short_repr(choice)}", param="tool_choice")


def _metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise APIError("'metadata' must be an object of at most 16 string values (keys up to 64 characters, values "
                       "up to 512)", param="metadata")
    return metadata


def _service_tier(body: dict) -> str:
    tier = get_str(body, "service_tier", "auto")
    if tier not in _SERVICE_TIERS:
        raise APIError(f"'service_tier' must be one of {', '.join(_SERVICE_TIERS)}", param="service_tier")
    return tier


# ---- the Response ----------------------------------------------------------------------------------------------

def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(turn: ResponsesTurn, req: GenerationRequest, *, id: str, created_at: int, status: str,
                     output: list, usage: dict | None, prompt_tokens: int, max_model_len: int) -> dict:
    """A Response, with the request's settings echoed as vLLM echoes them (the sampling ones as sampled)."""
    params = req.params
    budget = max_model_len - prompt_tokens
    body = {"id": id, "created_at": created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": turn.echo["instructions"], "metadata": turn.echo["metadata"], "model": req.model,
            "object": "response", "output": output, "parallel_tool_calls": turn.echo["parallel_tool_calls"],
            "temperature": params.temperature, "tool_choice": turn.echo["tool_choice"],
            "tools": turn.echo["tools"], "top_p": params.top_p, "background": False,
            "max_output_tokens": budget if params.max_tokens is None else min(params.max_tokens, budget),
            "max_tool_calls": turn.echo["max_tool_calls"], "previous_response_id": None, "prompt": None,
            "reasoning": None, "service_tier": turn.echo["service_tier"], "status": status,
            "text": turn.echo["text"], "top_logprobs": req.logprobs, "truncation": turn.echo["truncation"],
            "usage": usage, "user": turn.echo["user"], "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty}
    return body


def usage(chat_usage: dict) -> dict:
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_logprobs(chat_logprobs: dict | None) -> list | None:
    """Chat's ``logprobs.content`` entries are the Response's ``output_text.logprobs`` entries."""
    return None if chat_logprobs is None else chat_logprobs["content"]


def message_item(text: str, logprobs: list | None, id: str | None = None) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}] if text else []
    return {"id": id or item_id("msg"), "type": "message", "role": "assistant", "status": "completed",
            "content": content}


def call_item(call_id: str, name: str, arguments: str, id: str | None = None) -> dict:
    return {"id": id or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def response_body(turn: ResponsesTurn, req: GenerationRequest, chat: dict, request_id: str,
                  max_model_len: int) -> dict:
    """A whole chat answer (``serving.full_response``'s) as a Response: the message's text (an item with no
    content when empty, as vLLM's), then its tool calls."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(message.get("content") or "", output_logprobs(choice.get("logprobs"))))
    for call in message.get("tool_calls") or ():
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    body = response_object(turn, req, id=response_id(request_id), created_at=chat["created"],
                           status=status(choice["finish_reason"]), output=output, usage=usage(chat["usage"]),
                           prompt_tokens=chat["usage"]["prompt_tokens"], max_model_len=max_model_len)
    if chat.get("kv_transfer_params") is not None:
        body["kv_transfer_params"] = chat["kv_transfer_params"]
    return body


def now() -> int:
    return int(time.time())
