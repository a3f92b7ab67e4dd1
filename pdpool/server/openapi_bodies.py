"""The request bodies of ``pdpool.server.openapi``, one builder per endpoint: what its parser accepts (OpenAI's
completions and chat, the Responses API, Anthropic's Messages and count_tokens, vLLM's tokenize and detokenize),
built from ``openapi_fields``' shared groups. ``model`` is the schema of a served model name; ``vocab_size`` and
``max_model_len``, where known, bound token ids and lengths."""

from __future__ import annotations

from pdpool.server import responses
from pdpool.server.openapi_fields import (CONTINUE_RULE, SET, STREAM_RULE, chat_messages, chat_template_field,
                                          common_fields, integer, needs, nullable, sampling_fields,
                                          template_kwargs_field, token_id)
from pdpool.server.protocol import MAX_LOGPROBS, MAX_N


def completion_body(model: dict, vocab_size: int | None, max_model_len: int | None) -> dict:
    token = token_id(vocab_size)
    ids = {"type": "array", "items": token, "minItems": 1}
    if max_model_len is not None:
        ids["maxItems"] = max_model_len
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "description": "The prompt's tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **common_fields(model), **sampling_fields(vocab_size, max_model_len),
            "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}, ids,
                                 {"type": "array", "items": ids, "minItems": 1}]},
            "max_tokens": nullable({**integer(0), "description": "0 only with echo (the prompt alone)"}),
            "logprobs": nullable(integer(0, MAX_LOGPROBS)),
            "echo": nullable({"type": "boolean"}),
            "best_of": nullable({**integer(1, MAX_N), "description": "equal to n"}),
        },
        "allOf": [STREAM_RULE, needs("max_tokens", {"const": 0}, "echo", True)],
    }


def chat_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
              chat_template: bool = False) -> dict:
    return {
        "type": "object", "required": ["messages"], "additionalProperties": True,
        "description": "The rendered chat's tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **common_fields(model), **sampling_fields(vocab_size, max_model_len),
            "messages": chat_messages(),
            "max_tokens": nullable({**integer(1), "description": "max_completion_tokens, when set, wins"}),
            "max_completion_tokens": nullable({**integer(1), "description": "max_tokens' new name"}),
            "logprobs": nullable({"type": "boolean"}),
            "top_logprobs": nullable(integer(0, MAX_LOGPROBS)),
            "add_generation_prompt": nullable({"type": "boolean"}),
            "continue_final_message": nullable({"type": "boolean", "description": (
                "true needs add_generation_prompt false and the last message the assistant's")}),
            "echo": nullable({"type": "boolean", "description": (
                "the last message's content starts the answer when its role is the answer's (the assistant's, or "
                "with add_generation_prompt false the last message's own)")}),
            "chat_template": chat_template_field(chat_template),
            "chat_template_kwargs": template_kwargs_field(chat_template),
            **_tools(auto_tool_choice),
        },
        "allOf": [STREAM_RULE, CONTINUE_RULE, needs("top_logprobs", SET, "logprobs", True),
                  # a call needs tools (pdpool/server/tools.py)
                  {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
                   "then": {"required": ["tools"], "properties": {"tools": SET}}}]
                 + ([] if auto_tool_choice else [   # tools without tool_choice are "auto": refused without a parser
                     {"if": {"required": ["tools"], "properties": {"tools": SET}},
                      "then": {"required": ["tool_choice"], "properties": {"tool_choice": SET}}}]),
    }


def _tools(auto_tool_choice: bool = False) -> dict:
    """``tools`` and ``tool_choice`` (``pdpool/server/tools.py``): "required" or a named function constrains the
    answer to the tools' schemas; "auto" needs a model-specific parser (``auto_tool_choice``: the server has
    one), else it is refused."""
    name = {"type": "string", "minLength": 1}
    function = {"type": "object", "required": ["name"], "properties": {
        "name": name, "description": nullable({"type": "string"}),
        "parameters": nullable({"type": "object", "description": "a JSON schema (it must compile)"})}}
    named = {"type": "object", "required": ["function"], "properties": {   # type: "function" when absent
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": nullable({"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["function"],   # type: "function" when absent, as in vLLM
            "properties": {"type": {"const": "function"}, "function": function}}}),
        "tool_choice": nullable({"anyOf": [{"enum": ["none", "required", *(["auto"] if auto_tool_choice else [])]},
                                            named], "description": (
            "\"required\" or a function of tools (by name): a call constrained to the tools' schemas; \"none\": "
            "text; \"auto\" (the default with tools): " + (
                "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice else
                "refused (the server runs without --enable-auto-tool-choice)"))}),
        "parallel_tool_calls": nullable({"type": "boolean"}),
    }


def responses_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
                   chat_template: bool = False) -> dict:
    """``pdpool.server.responses.translate``'s fields: what it passes on to chat, and its own."""
    text = {"type": "string"}
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(responses._TEXT_PARTS)}, "text": text}}
    content = {"anyOf": [text, {"type": "array", "items": part}]}
    items = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"}, "role": {"enum": list(responses._ROLES)}, "content": content}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": text, "name": text, "arguments": text}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": text, "output": content}}]}
    formats = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "schema"], "properties": {
            "type": {"const": "json_schema"}, "name": nullable(text), "description": nullable(text),
            "schema": {"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "a JSON schema"},
            "strict": nullable({"type": "boolean"})}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}, "description": nullable(text),
        "parameters": nullable({"type": "object", "description": "a JSON schema (it must compile)"})}}
    named = {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                             "name": text}}
    sampling = sampling_fields(vocab_size, max_model_len)
    passed = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
              "include_stop_str_in_output")
    common = common_fields(model)
    refused = {"type": "null", "description": "refused: no stored state, no reasoning, no prompt templates"}
    return {
        "type": "object", "required": ["input"], "additionalProperties": True,
        "description": "The rendered input's tokens and max_output_tokens must fit the context (max_model_len). "
                       "Without tools, tool_choice \"auto\" and \"none\" are text, the others refused.",
        "properties": {
            **{name: common[name] for name in ("model", "stream", "priority", "cache_salt", "user")},
            **{name: sampling[name] for name in passed},
            "input": {"anyOf": [text, {"type": "array", "items": items, "minItems": 1}]},
            "instructions": nullable({**text, "description": "a system message first"}),
            "max_output_tokens": nullable(integer(1)),
            "text": nullable({"type": "object", "properties": {"format": nullable(formats)}}),
            "tools": nullable({"type": "array", "items": tool}),
            "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named], "description": (
                "with tools: \"required\" or a function of tools (by name), a call constrained to their schemas; "
                "\"none\": text; \"auto\" (the default): " + (
                    "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice else
                    "refused (the server runs without --enable-auto-tool-choice)"))}),
            "parallel_tool_calls": nullable({"type": "boolean"}),
            "include": nullable({"type": "array", "items": {"enum": list(responses._INCLUDE)},
                                  "description": "message.output_text.logprobs: the output text's logprobs"}),
            "top_logprobs": nullable(integer(0, MAX_LOGPROBS)),
            "metadata": nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                   "additionalProperties": {"type": "string", "maxLength": 512}}),
            "store": nullable({"type": "boolean", "description": "taken and ignored: nothing is stored"}),
            "background": nullable({"const": False, "description": "true is refused (no stored state)"}),
            "truncation": nullable({"enum": list(responses._TRUNCATION)}),
            "service_tier": nullable({"enum": list(responses._SERVICE_TIERS)}),
            "max_tool_calls": nullable(integer(0)),
            "previous_response_id": refused, "reasoning": refused, "prompt": refused, "conversation": refused,
            "chat_template_kwargs": template_kwargs_field(chat_template),
        },
        "allOf": [   # a call needs tools (vLLM's check_tool_usage); tools without tool_choice are "auto"
            {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [
                {"const": "required"}, {"type": "object"}]}}},
             "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}]
        + ([] if auto_tool_choice else [   # ... refused without a parser
            {"if": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
             "then": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "auto"]}}}}}]),
    }


def _anthropic_messages() -> dict:
    """``anthropic_messages._messages``: each role's blocks; at least one user or assistant message."""
    text = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"},
                                                                            "text": {"type": "string"}}}
    texts = {"type": "array", "items": text}
    tool_use = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "tool_use"}, "id": nullable({"type": "string"}), "name": {"type": "string"},
        "input": nullable({"type": "object"})}}
    tool_result = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
        "content": nullable({"anyOf": [{"type": "string"}, texts]})}}
    thinking = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["thinking",
                                                                                         "redacted_thinking"]}}}

    def message(role: str, *blocks: dict) -> dict:
        return {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": role},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": list(blocks)}}]}}}

    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        message("user", text, tool_result), message("assistant", text, tool_use, thinking),
        {**message("system", text), "description": "vLLM's: a system message in place"}]},
        "contains": {"type": "object", "properties": {"role": {"enum": ["user", "assistant"]}}},
        "description": "text blocks (tool_use and thinking in assistant messages, tool_result in user messages); "
                       "images and documents are refused: the served model reads text only"}


def _anthropic_fields(model: dict, auto_tool_choice: bool) -> dict:
    """What a Messages body and a count_tokens body share."""
    text = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"},
                                                                            "text": {"type": "string"}}}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "type": nullable({"const": "custom"}), "name": {"type": "string", "minLength": 1},
        "description": nullable({"type": "string"}),
        "input_schema": {"type": "object", "description": "a JSON schema (it must compile)"}}}
    choice = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": nullable({"type": "string"}),
        "disable_parallel_tool_use": nullable({"type": "boolean"})},
        "if": {"properties": {"type": {"const": "tool"}}}, "then": {"required": ["name"],
                                                                      "properties": {"name": {"type": "string"}}},
        "description": "any: a call constrained to the tools' schemas; tool: the named one's (of tools); none: text; "
                       "auto (the default with tools): " + (
                           "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice
                           else "refused (the server runs without --enable-auto-tool-choice)")}
    thinking = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive"]}}},
        {"type": "object", "required": ["type", "budget_tokens"], "properties": {
            "type": {"const": "enabled"}, "budget_tokens": {**integer(1024), "description": "below max_tokens"}}}],
        "description": "checked and ignored: the served model does not think"}
    output_config = {"type": "object", "properties": {"format": nullable({
        "type": "object", "properties": {"type": {"const": "json_schema"}, "schema": nullable({
            "type": "object", "description": "a JSON schema (it must compile): the answer's text follows it"})}})}}
    return {"model": model, "messages": _anthropic_messages(),
            "system": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": text}]}),
            "tools": nullable({"type": "array", "items": tool}), "tool_choice": nullable(choice),
            "thinking": nullable(thinking), "output_config": nullable(output_config)}


def anthropic_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
                   chat_template: bool = False) -> dict:
    """``pdpool.server.anthropic_messages.translate``'s fields: its own, and those it passes on to chat."""
    sampling = sampling_fields(vocab_size, max_model_len)
    word = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True,
        "description": "The rendered messages' tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **_anthropic_fields(model, auto_tool_choice),
            **{name: sampling[name] for name in ("temperature", "top_p", "top_k")},
            "max_tokens": integer(1), "stop_sequences": nullable({"type": "array", "items": word}),
            "stream": nullable({"type": "boolean"}), "cache_salt": common_fields(model)["cache_salt"],
            "metadata": nullable({"type": "object", "properties": {"user_id": nullable({"type": "string"})}}),
            "chat_template_kwargs": template_kwargs_field(chat_template),
        },
        "allOf": [   # a call needs tools; tools without tool_choice are "auto"
            {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
                "type": "object", "properties": {"type": {"not": {"const": "none"}}}}}},
             "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}]
        + ([] if auto_tool_choice else [
            {"if": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
             "then": {"required": ["tool_choice"], "properties": {"tool_choice": {
                 "type": "object", "properties": {"type": {"not": {"const": "auto"}}}}}}}]),
    }


def count_tokens_body(model: dict, chat_template: bool = False) -> dict:
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": True, "properties": {
        **_anthropic_fields(model, True), "chat_template_kwargs": template_kwargs_field(chat_template)}}


def tokenize_body(model: dict, chat_template: bool = False) -> dict:
    flags = {name: nullable({"type": "boolean"}) for name in (
        "add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs")}
    return {"type": "object", "additionalProperties": True,
            "properties": {"model": nullable(model), "prompt": {"type": "string"}, "messages": chat_messages(),
                           "chat_template": chat_template_field(chat_template),
                           "chat_template_kwargs": template_kwargs_field(chat_template),
                           **flags},
            # continue_final_message is read with messages only (a prompt is tokenized as it is)
            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
            "allOf": [{"if": {"required": ["messages"]}, "then": CONTINUE_RULE}],
            "description": "prompt or messages, not both; add_special_tokens defaults to true with prompt, false "
                           "with messages"}


def detokenize_body(model: dict, vocab_size: int | None) -> dict:
    return {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
        "model": nullable(model), "tokens": {"type": "array", "items": token_id(vocab_size)}}}
