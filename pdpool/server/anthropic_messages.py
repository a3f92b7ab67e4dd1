"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the chat path, as vLLM 0.32
serves it for a plain chat model.

A Messages body is translated into the chat completions body it means (``translate``), which the one chat front
end (``protocol.parse_chat``) validates, renders and samples; the chat answer is translated back (``message_body``;
``pdpool.server.anthropic_events`` for the stream). Node and router share this module: the router routes a Messages
request exactly as its chat body, and the decode node answers with a Message.

    system (string or text blocks)   -> a system message first (vLLM's: blocks joined, Claude Code's per-request
                                        billing header dropped so that the prefix cache holds)
    messages: text blocks            -> the message's text parts
              tool_use (assistant)   -> the assistant's tool_calls (input as JSON arguments)
              tool_result (user)     -> a tool message, before the user's own text
              thinking, redacted_thinking -> dropped (a plain model has no reasoning to continue)
              image, document        -> a 400: the served model reads text only
    max_tokens (required)            -> max_tokens;  stop_sequences -> stop
    tools, tool_choice               -> chat's tools; auto/any/tool/none -> "auto"/"required"/named/"none" (tools
                                        without tool_choice: "auto", as vLLM's; disable_parallel_tool_use ->
                                        parallel_tool_calls false)
    output_config.format             -> response_format json_schema
    metadata, thinking, output_config.effort -> checked and ignored (a plain model does not think)

The answer's ``stop_reason``: "max_tokens" when cut, "tool_use" when it called a tool (complete calls win over a
stop string), "stop_sequence" (with ``stop_sequence``) when a stop string ended it, else "end_turn". Its usage
follows Anthropic's sums: ``input_tokens`` are the prompt tokens not read from the prefix cache, and
``cache_read_input_tokens`` those that were.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pdpool.engine.sampling_params import short_repr
from pdpool.server.errors import ANTHROPIC_PATHS, APIError
from pdpool.server.protocol import GenerationRequest, get_bool, get_int, parse_translated_chat

PATH = ANTHROPIC_PATHS
COUNT_TOKENS_PATH = PATH + "/count_tokens"
# vLLM's Messages fields that mean the same in a chat body, passed on as they are
_PASSED = ("model", "temperature", "top_p", "top_k", "cache_salt", "kv_transfer_params", "chat_template_kwargs",
           "pdpool_prompt_token_ids")
# a chat error's field -> the Messages field the client sent
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config",
           "parallel_tool_calls": "tool_choice", "stream_options": "stream"}
_ROLES = ("user", "assistant", "system")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_BILLING_HEADER = "x-anthropic-billing-header"   # Claude Code's, a per-request hash
_STOP_REASONS = {"length": "max_tokens"}


@dataclass
class MessagesTurn:
    """A Messages request as translated: the chat body it means."""
    chat: dict


def translate(body: dict, *, count_tokens: bool = False) -> MessagesTurn:
    """``body`` (a Messages request, or a count_tokens one) -> its chat body; every refusal a 400 naming the
    Messages field."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise APIError(f"'model' must be a non-empty string, got {short_repr(body.get('model'))}", param="model")
    chat = {name: body[name] for name in _PASSED if name in body}
    messages = _system(body.get("system"))
    messages += _messages(body.get("messages"))
    chat["messages"] = messages
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"], parallel = tool_choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    budget = _thinking(body.get("thinking"))
    response_format = _output_config(body.get("output_config"))
    if count_tokens:
        return MessagesTurn(chat)
    if body.get("max_tokens") is None:
        raise APIError("'max_tokens' is required", param="max_tokens")
    chat["max_tokens"] = get_int(body, "max_tokens", ge=1)
    if budget is not None and budget >= chat["max_tokens"]:   # vLLM's rule, though a plain model never thinks
        raise APIError("'thinking.budget_tokens' must be less than 'max_tokens'", param="thinking")
    if body.get("stop_sequences") is not None:
        stop = body["stop_sequences"]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(f"'stop_sequences' must be a list of strings, got {short_repr(stop)}",
                           param="stop_sequences")
        chat["stop"] = stop
    if response_format is not None:
        chat["response_format"] = response_format
    _metadata(body.get("metadata"))
    chat["stream"] = get_bool(body, "stream")
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}   # message_delta's usage
    return MessagesTurn(chat)


def parse(body: dict, parse_chat, *, count_tokens: bool = False) -> tuple[MessagesTurn, GenerationRequest]:
    """``body`` translated and parsed by ``parse_chat(chat_body) -> GenerationRequest`` (the node's or the
    router's own ``protocol.parse_chat``); a chat refusal names the Messages field the client sent."""
    turn = translate(body, count_tokens=count_tokens)
    return turn, parse_translated_chat(turn.chat, parse_chat, _PARAMS)


# ---- the request -------------------------------------------------------------------------------------------

def _system(system) -> list[dict]:
    if system is None:
        return []
    text = _system_text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _system_text(content, where: str) -> str:
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_HEADER) else content
    if not isinstance(content, list):
        raise APIError(f"'{where}' must be a string or a list of text blocks, got {short_repr(content)}",
                       param=where.split("[")[0])
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(f"'{where}' blocks must be text blocks, got {short_repr(block)}", param=where.split("[")[0])
        if not block["text"].startswith(_BILLING_HEADER):
            texts.append(block["text"])
    return "".join(texts)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(f"'messages' must be a non-empty list, got {short_repr(messages)}", param="messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise APIError(f"messages[{i}] must be an object whose role is user or assistant, got "
                           f"{short_repr(message)}", param="messages")
        role, content = message["role"], message.get("content")
        if role == "system":   # vLLM's: a system message in place
            text = _system_text(content, f"messages[{i}].content")
            if text:
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(content, role, i)
        else:
            raise APIError(f"messages[{i}].content must be a string or a list of content blocks, got "
                           f"{short_repr(content)}", param="messages")
    return out


def _blocks(blocks: list, role: str, i: int) -> list[dict]:
    """One message's blocks -> its chat messages: a user's tool results first (tool messages), then the message
    (left out when a user's holds tool results alone, as vLLM's)."""
    parts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise APIError(f"{where}.text must be a string", param="messages")
            if text:
                parts.append({"type": "text", "text": text})
        elif kind == "tool_use" and role == "assistant":
            name, arguments = block.get("name"), block.get("input")
            arguments = {} if arguments is None else arguments
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise APIError(f"{where}: a tool_use block needs a string 'name' and an object 'input'",
                               param="messages")
            calls.append({"id": _str_or(block.get("id"), where, "id") or f"toolu_{uuid.uuid4().hex[:24]}",
                          "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(f"{where}.tool_use_id must be a string", param="messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block.get("content"), where)})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind in ("image", "document"):
            raise APIError(f"{where}: {kind} blocks are not supported: the served model reads text only",
                           param="messages")
        else:
            raise APIError(f"{where}: {short_repr(kind)} blocks are not supported in a {role} message (text, "
                           "tool_use in assistant messages, tool_result in user messages, thinking are)",
                           param="messages")
    message: dict = {"role": role}
    if parts:
        message["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if role == "assistant" or parts or not results else [])


def _str_or(value, where: str, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise APIError(f"{where}.{name} must be a string, got {short_repr(value)}", param="messages")
    return value


def _result_text(content, where: str) -> str:
    """A tool result's content: a string, or text blocks (one a line, as vLLM's)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of text blocks", param="messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else block
            raise APIError(f"{where}.content: only text blocks are supported, got {short_repr(kind)}",
                           param="messages")
        texts.append(block["text"])
    return "\n".join(texts)


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(f"'tools' must be a list, got {short_repr(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                or not isinstance(tool.get("input_schema"), dict) or tool.get("type") not in (None, "custom"):
            raise APIError(f"tools[{i}] must be a client tool with a string 'name' and an object 'input_schema' "
                           f"(server tools are not supported), got {short_repr(tool)}", param="tools")
        function = {"name": tool["name"], "parameters": {"type": "object", **tool["input_schema"]}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> tuple[str | dict, bool | None] | None:
    """Chat's tool_choice and parallel_tool_calls (None: not set)."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or not isinstance(name, str if kind == "tool" else (str, type(None))):
        raise APIError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                       f"\"name\": ...}}, got {short_repr(choice)}", param="tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise APIError("'tool_choice.disable_parallel_tool_use' must be a boolean", param="tool_choice")
    mapped = {"type": "function", "function": {"name": choice["name"]}} if kind == "tool" else _TOOL_CHOICES[kind]
    return mapped, None if disable is None else not disable


def _thinking(thinking) -> int | None:
    """Checked as vLLM checks it, then ignored (a plain model does not think); its budget_tokens, if enabled."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(f"'thinking.type' must be enabled, disabled or adaptive, got {short_repr(thinking)}",
                       param="thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, float) and budget.is_integer():
            budget = int(budget)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise APIError("'thinking.budget_tokens' must be an integer of at least 1024", param="thinking")
        return budget
    return None


def _output_config(config) -> dict | None:
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(config, dict) or fmt is not None and (
            not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema"
            or not isinstance(fmt.get("schema"), (dict, type(None)))):
        raise APIError(f"'output_config' must be an object whose format is of type json_schema, got "
                       f"{short_repr(config)}", param="output_config")
    if fmt is None or fmt.get("schema") is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}


def _metadata(metadata) -> None:
    if metadata is not None and (not isinstance(metadata, dict) or not isinstance(metadata.get("user_id", ""),
                                                                                    (str, type(None)))):
        raise APIError(f"'metadata' must be an object (user_id a string), got {short_repr(metadata)}",
                       param="metadata")


# ---- the Message ---------------------------------------------------------------------------------------------

def message_id(request_id: str) -> str:
    return f"msg_{request_id}"


def usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached}


def stop_reason(finish_reason: str | None, stop: int | str | None, called: bool,
                calls_complete: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence), vLLM's mapping: a cut answer is "max_tokens"; complete tool calls win over a
    stop string (one that cut a call short must not run it)."""
    if finish_reason in _STOP_REASONS:
        return _STOP_REASONS[finish_reason], None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if calls_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if finish_reason == "tool_calls" or called else "end_turn"), None


def tool_use_block(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json_object(arguments)}


def json_object(arguments: str) -> dict | None:
    """A call's arguments as an object, None when they are not one (cut short)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_object(id: str, model: str, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def message_body(req: GenerationRequest, chat: dict, request_id: str) -> dict:
    """A whole chat answer (``serving.full_response``'s) as a Message: its text, then its tool calls (a call whose
    arguments are no JSON object, cut by max_tokens, stays text); no content at all is one empty text block, as
    vLLM's."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    calls = []
    for call in message.get("tool_calls") or ():
        block = tool_use_block(call["id"], call["function"]["name"], call["function"]["arguments"])
        if block["input"] is None:
            content.append({"type": "text", "text": call["function"]["arguments"]})
        else:
            calls.append(block)
    content += calls or ([] if content else [{"type": "text", "text": ""}])
    stop = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls), bool(calls))
    body = message_object(message_id(request_id), req.model, content, stop, usage(chat["usage"]))
    if chat.get("kv_transfer_params") is not None:
        body["kv_transfer_params"] = chat["kv_transfer_params"]
    return body


def count_tokens_body(turn: MessagesTurn) -> dict:
    """The ``/tokenize`` body that renders the prompt a count_tokens request means."""
    return {name: turn.chat[name] for name in ("model", "messages", "tools", "chat_template_kwargs")
            if name in turn.chat}


def counted(tokenized: dict) -> dict:
    """``/tokenize``'s answer -> count_tokens'."""
    n = tokenized["count"]
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}
