"""``GET /openapi.json`` of a node and of the router: one builder, fed the (method, path) pairs each one serves.

The request bodies say what ``pdpool.server.protocol`` and ``pdpool.server.tokenize`` accept: each field's type
and bounds, the served model names, and the rules across fields that JSON Schema can say (``stream_options``
needs ``stream``; ``top_logprobs`` needs ``logprobs``; completions' ``max_tokens`` 0 needs ``echo``;
``continue_final_message`` needs ``add_generation_prompt`` false; /tokenize takes ``prompt`` or ``messages``).
Rules it cannot say (``min_tokens`` at most ``max_tokens``, ``best_of`` equal to ``n``, the prompt and
``max_tokens`` within the context, the last message the assistant's to continue it) are in the descriptions;
breaking one is a 400. Authentication is documented only when an API key
is set, and so is its 401.
"""

from __future__ import annotations

from pdpool.engine.sampling_params import _FLOAT32_MAX, LOGIT_BIAS_MAX, MAX_LOGIT_BIAS_ENTRIES, SEED_MAX, SEED_MIN
from pdpool.server import anthropic_messages, responses
from pdpool.server.protocol import MAX_LOGPROBS, MAX_N

_JSON = "application/json"
_ERROR = {"description": "OpenAI error", "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {  # what any request may get: every one an OpenAI error body
    "400": {**_ERROR, "description": "Bad request: the body or a field (named in `param`)"},
    "404": {**_ERROR, "description": "A model name that is not served"},
    "413": {**_ERROR, "description": "A body over 64 MiB"},
    "500": {**_ERROR, "description": "Internal error (a bug; the message names an error id from the log)"},
    "503": {**_ERROR, "description": "Not ready: the node loads or drains, or the router has no ready node"},
}
_ANTHROPIC_ERROR = {"description": "Anthropic error",
                    "content": {_JSON: {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
_GEN_ERRORS = {
    **_ERRORS,
    "429": {**_ERROR, "description": "Too many requests in flight (the router's --max-inflight, a prefill "
                                      "node's lease cap)"},
    "502": {**_ERROR, "description": "The router's upstream node failed"},
}

_DOCS = {
    ("POST", "/v1/completions"): "Text completion (OpenAI).",
    ("POST", "/v1/chat/completions"): "Chat completion (OpenAI).",
    ("POST", "/v1/responses"): "A response (OpenAI's Responses API, as vLLM serves it: no stored state).",
    ("POST", anthropic_messages.PATH): "A message (Anthropic's Messages API, as vLLM serves it); errors in "
                                       "Anthropic's shape.",
    ("POST", anthropic_messages.COUNT_TOKENS_PATH): "The input tokens of a Messages request's rendered prompt "
                                                    "(Anthropic's count_tokens).",
    ("GET", "/v1/models"): "The served model.",
    ("GET", "/v1/models/{model}"): "The served model's card by its name (OpenAI's retrieve), else 404.",
    ("GET", "/health/live"): "200 while the process runs.",
    ("GET", "/health/ready"): "200 when ready to serve (a router: at least one decode-capable node), else 503.",
    ("GET", "/metrics"): "Prometheus metrics.",
    ("GET", "/openapi.json"): "This document.",
    ("GET", "/version"): "The server's pdpool version (vLLM's route).",
    ("POST", "/tokenize"): "vLLM's tokenize: token ids of a prompt or of a chat (its template applied).",
    ("POST", "/detokenize"): "vLLM's detokenize: the text of token ids.",
}
_PLAIN = {"/metrics": "text/plain"}   # Prometheus' text format (a version parameter follows)
_NOT_READY = {"/health/ready"}   # /health, its alias, is left out of the document
_PUBLIC = ("/health", "/metrics", "/openapi.json", "/version")


def _nullable(schema: dict) -> dict:
    """``schema`` or null (``{"type": [T, "null"]}`` where one type is named)."""
    if not isinstance(schema.get("type"), str):
        return {"anyOf": [schema, {"type": "null"}]}
    out = {**schema, "type": [schema["type"], "null"]}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def _int(low: int | None = None, high: int | None = None) -> dict:
    s: dict = {"type": "integer"}
    if low is not None:
        s["minimum"] = low
    if high is not None:
        s["maximum"] = high
    return s


def _num(low: float | None, high: float | None, *, low_open: bool = False) -> dict:
    s: dict = {"type": "number"}
    if low is not None:
        s["exclusiveMinimum" if low_open else "minimum"] = low
    s["maximum"] = _FLOAT32_MAX if high is None else high
    return s


def _token_id(vocab_size: int | None) -> dict:
    return _int(0, None if vocab_size is None else vocab_size - 1)


def _token_id_key(vocab_size: int | None) -> str:
    """A regex for ``logit_bias``' keys as the parser takes them (``[+-]?[0-9]{1,19}``, an int in the vocabulary
    where its size is known: a sign and leading zeros allowed, 19 digits at most)."""
    if vocab_size is None:
        return r"^[+-]?[0-9]{1,19}$"
    return rf"^(?:\+?(?:{'|'.join(_decimal_below(vocab_size, 19))})|-0{{1,19}})$"


def _decimal_below(n: int, digits: int) -> list[str]:
    """Regexes for the integers in [0, n) written in at most ``digits`` digits (leading zeros allowed).

    For n - 1 = 49151: 0{1,19} | 0{0,18}[1-9] | ... | 0{0,14}[1-3][0-9]{4} | 0{0,14}4[0-8][0-9]{3} | ... | 0{0,14}4915[0-1]
    """
    top = str(n - 1)
    alternatives = [f"0{{1,{digits}}}"]
    for length in range(1, len(top)):          # fewer digits than top
        alternatives.append(f"0{{0,{digits - length}}}[1-9]" + "[0-9]" * (length - 1))
    zeros = f"0{{0,{digits - len(top)}}}"
    for i, digit in enumerate(top):            # top's first i digits, then a smaller digit (top's own, last)
        low, high = (1 if i == 0 else 0), (int(digit) if i == len(top) - 1 else int(digit) - 1)
        if high >= low:
            alternatives.append(f"{zeros}{top[:i]}[{low}-{high}]" + "[0-9]" * (len(top) - 1 - i))
    return alternatives


def _sampling(vocab_size: int | None, max_model_len: int | None) -> dict:
    """The sampling fields both endpoints share (``protocol._sampling_fields``, ``SamplingParams.validate``)."""
    token = _token_id(vocab_size)
    word = {"type": "string", "minLength": 1}
    return {
        "temperature": _nullable(_num(0, None)),
        "top_p": _nullable(_num(0, 1, low_open=True)),
        "top_k": _nullable({**_int(-1), "description": "-1 or 0: no top-k"}),
        "min_p": _nullable(_num(0, 1)),
        "presence_penalty": _nullable(_num(-2, 2)),
        "frequency_penalty": _nullable(_num(-2, 2)),
        "repetition_penalty": _nullable(_num(0, 2, low_open=True)),
        "seed": _nullable({**_int(SEED_MIN, SEED_MAX), "description": "with n > 1, choice j is seeded seed + j, so "
                                                                      "seed + n - 1 must stay in range"}),
        "stop": _nullable({"anyOf": [word, {"type": "array", "items": word}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "min_tokens": _nullable({**_int(0), "description": "at most max_tokens"}),
        "include_stop_str_in_output": _nullable({"type": "boolean"}),
        "skip_special_tokens": _nullable({"type": "boolean"}),
        "logit_bias": _nullable({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": _token_id_key(vocab_size)},
            "additionalProperties": {"type": "number", "description": f"clamped to [-{LOGIT_BIAS_MAX:g}, "
                                                                      f"{LOGIT_BIAS_MAX:g}]"},
            "description": "token id (a decimal string in the vocabulary) -> bias"}),
        "truncate_prompt_tokens": _nullable({"anyOf": [{"const": -1}, _int(1, max_model_len)],
                                             "description": "keep the prompt's last N tokens (-1: the context)"}),
        "allowed_token_ids": _nullable({"type": "array", "items": token, "minItems": 1}),
        "bad_words": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": word}],
                                "description": "words never generated (one string: one word; \"\": none)"}),
        **_structured(),
    }


def _structured() -> dict:
    """Structured output (``protocol._structured``): at most one of these constrains the output, and a schema,
    regex or grammar must compile (llguidance's dialects), which JSON Schema cannot say."""
    text = {"type": "string", "minLength": 1}
    schema = {"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "a JSON schema"}
    choices = {"type": "array", "items": text, "minItems": 1}
    tag = {"type": "object", "required": ["structures", "triggers"], "properties": {
        "structures": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["begin", "schema", "end"],
            "properties": {"begin": {"type": "string"}, "schema": schema, "end": {"type": "string"}}}},
        "triggers": {"type": "array", "items": text}},
        "description": "vLLM's structural tag: each begin starts with one of the triggers (xgrammar's 'format' shape "
                       "is refused)"}
    kinds = {"json": {"anyOf": [schema, {"type": "string", "description": "a JSON schema as text"}]},
             "regex": text, "choice": choices, "grammar": {**text, "description": "Lark or GBNF"},
             "json_object": {"type": "boolean"},
             "structural_tag": {"anyOf": [tag, {"type": "string", "description": "the structural tag as JSON text"}]}}
    return {
        "response_format": _nullable({"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": _nullable({"type": "string"}), "description": _nullable({"type": "string"}),
                    "schema": schema, "strict": _nullable({"type": "boolean"})}}}},
            {**tag, "required": ["type", *tag["required"]],
             "properties": {"type": {"const": "structural_tag"}, **tag["properties"]}}]}),
        "structured_outputs": _nullable({
            "type": "object", "additionalProperties": False,
            "properties": {**{k: _nullable(v) for k, v in kinds.items()},
                           "disable_any_whitespace": {"type": "boolean"}, "disable_fallback": {"type": "boolean"},
                           "disable_additional_properties": {"type": "boolean"},
                           "whitespace_pattern": _nullable({"type": "string"})},
            "oneOf": [{"required": [k], "properties": {k: {"const": True} if k == "json_object" else _SET}}
                      for k in kinds],
            "description": "vLLM's: exactly one of json, regex, choice, grammar, structural_tag (not null) and "
                           "json_object (true)"}),
        "guided_json": _nullable(kinds["json"]), "guided_regex": _nullable(text),
        "guided_choice": _nullable(choices), "guided_grammar": _nullable(kinds["grammar"]),
    }


def _common(model: dict) -> dict:
    """``protocol._common``'s fields (the ones a client sends; refusals of unimplemented features are omitted)."""
    return {
        "model": _nullable(model),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"}),
            "continuous_usage_stats": _nullable({"type": "boolean"})}}),
        "n": _nullable(_int(1, MAX_N)),
        "prompt_logprobs": _nullable(_int(0, MAX_LOGPROBS)),
        "priority": _nullable(_int(SEED_MIN, SEED_MAX)),
        "cache_salt": _nullable({"type": "string"}),
        "user": _nullable({"type": "string"}),
        "return_token_ids": _nullable({"type": "boolean"}),
        "return_tokens_as_token_ids": _nullable({"type": "boolean", "description": (
            "logprobs name tokens 'token_id:<id>' (null: the server's --return-tokens-as-token-ids)")}),
        "use_beam_search": _nullable({"type": "boolean", "description": (
            "vLLM's beam search, n beams wide (n at most 10): the choices are the n best beams. Not with a "
            "streamed completion, logprobs, echo, prompt_logprobs, a constraint, stop, min_tokens, penalties, "
            "top_p/top_k/min_p, logit_bias, allowed_token_ids or bad_words")}),
        "length_penalty": _nullable({"type": "number", "description": (
            "beam search: a beam's score is its log probability over its length to this power")}),
    }


def _needs(field: str, when: dict, other: str, value) -> dict:
    """The rule "``field`` matching ``when`` needs ``other`` set to ``value``" (if/then: schemathesis draws these
    far faster than dependentSchemas with anyOf)."""
    return {"if": {"required": [field], "properties": {field: when}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


_SET = {"not": {"type": "null"}}
_STREAM_RULE = _needs("stream_options", _SET, "stream", True)                         # protocol._stream_options
_CONTINUE_RULE = _needs("continue_final_message", {"const": True}, "add_generation_prompt", False)  # its default: true


def _completion_body(model: dict, vocab_size: int | None, max_model_len: int | None) -> dict:
    token = _token_id(vocab_size)
    ids = {"type": "array", "items": token, "minItems": 1}
    if max_model_len is not None:
        ids["maxItems"] = max_model_len
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "description": "The prompt's tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **_common(model), **_sampling(vocab_size, max_model_len),
            "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}, ids,
                                 {"type": "array", "items": ids, "minItems": 1}]},
            "max_tokens": _nullable({**_int(0), "description": "0 only with echo (the prompt alone)"}),
            "logprobs": _nullable(_int(0, MAX_LOGPROBS)),
            "echo": _nullable({"type": "boolean"}),
            "best_of": _nullable({**_int(1, MAX_N), "description": "equal to n"}),
        },
        "allOf": [_STREAM_RULE, _needs("max_tokens", {"const": 0}, "echo", True)],
    }


def _messages() -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["function"], "properties": {   # protocol._history_tool_calls
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string"},
        "content": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}),
        "tool_calls": _nullable({"type": "array", "items": call}),
        "tool_call_id": _nullable({"type": "string"}), "name": _nullable({"type": "string"})}}
    return {"type": "array", "items": message, "minItems": 1}


def _chat_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
               chat_template: bool = False) -> dict:
    return {
        "type": "object", "required": ["messages"], "additionalProperties": True,
        "description": "The rendered chat's tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **_common(model), **_sampling(vocab_size, max_model_len),
            "messages": _messages(),
            "max_tokens": _nullable({**_int(1), "description": "max_completion_tokens, when set, wins"}),
            "max_completion_tokens": _nullable({**_int(1), "description": "max_tokens' new name"}),
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable(_int(0, MAX_LOGPROBS)),
            "add_generation_prompt": _nullable({"type": "boolean"}),
            "continue_final_message": _nullable({"type": "boolean", "description": (
                "true needs add_generation_prompt false and the last message the assistant's")}),
            "echo": _nullable({"type": "boolean", "description": (
                "the last message's content starts the answer when its role is the answer's (the assistant's, or "
                "with add_generation_prompt false the last message's own)")}),
            "chat_template": _chat_template(chat_template), "chat_template_kwargs": _template_kwargs(chat_template),
            **_tools(auto_tool_choice),
        },
        "allOf": [_STREAM_RULE, _CONTINUE_RULE, _needs("top_logprobs", _SET, "logprobs", True),
                  # a call needs tools (pdpool/server/tools.py)
                  {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
                   "then": {"required": ["tools"], "properties": {"tools": _SET}}}]
                 + ([] if auto_tool_choice else [   # tools without tool_choice are "auto": refused without a parser
                     {"if": {"required": ["tools"], "properties": {"tools": _SET}},
                      "then": {"required": ["tool_choice"], "properties": {"tool_choice": _SET}}}]),
    }


def _tools(auto_tool_choice: bool = False) -> dict:
    """``tools`` and ``tool_choice`` (``pdpool/server/tools.py``): "required" or a named function constrains the
    answer to the tools' schemas; "auto" needs a model-specific parser (``auto_tool_choice``: the server has
    one), else it is refused."""
    name = {"type": "string", "minLength": 1}
    function = {"type": "object", "required": ["name"], "properties": {
        "name": name, "description": _nullable({"type": "string"}),
        "parameters": _nullable({"type": "object", "description": "a JSON schema (it must compile)"})}}
    named = {"type": "object", "required": ["function"], "properties": {   # type: "function" when absent
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": _nullable({"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["function"],   # type: "function" when absent, as in vLLM
            "properties": {"type": {"const": "function"}, "function": function}}}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "required", *(["auto"] if auto_tool_choice else [])]},
                                            named], "description": (
            "\"required\" or a function of tools (by name): a call constrained to the tools' schemas; \"none\": "
            "text; \"auto\" (the default with tools): " + (
                "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice else
                "refused (the server runs without --enable-auto-tool-choice)"))}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
    }


def _chat_template(trusted: bool) -> dict:
    """A request's ``chat_template``: with --trust-request-chat-template a jinja template (one that does not
    render is a 400 naming it); without, only null."""
    if trusted:
        return _nullable({"type": "string", "description": "a jinja chat template in place of the model's (\"\": "
                                                           "the model's); one that fails to render is a 400"})
    return {"type": "null", "description": "a request's template needs --trust-request-chat-template"}


def _template_kwargs(trusted: bool) -> dict:
    """``chat_template_kwargs``: ``tokenize`` refused; ``chat_template`` a request template (trusted only)."""
    if trusted:
        return _nullable({"type": "object", "not": {"required": ["tokenize"]},
                          "properties": {"chat_template": _nullable({"type": "string"})},
                          "description": "more variables for the chat template (enable_thinking, say): those it "
                                         "reads are passed; chat_template is the request's template (vLLM's older "
                                         "way), tokenize is refused"})
    return _nullable({"type": "object", "not": {"required": ["tokenize"]},
                      "properties": {"chat_template": {"type": "null"}},
                      "description": "more variables for the chat template (enable_thinking, say): those it reads "
                                     "are passed; tokenize, and a chat_template (it needs "
                                     "--trust-request-chat-template), are refused"})


def _responses_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
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
            "type": {"const": "json_schema"}, "name": _nullable(text), "description": _nullable(text),
            "schema": {"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "a JSON schema"},
            "strict": _nullable({"type": "boolean"})}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}, "description": _nullable(text),
        "parameters": _nullable({"type": "object", "description": "a JSON schema (it must compile)"})}}
    named = {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                             "name": text}}
    sampling = _sampling(vocab_size, max_model_len)
    passed = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
              "include_stop_str_in_output")
    common = _common(model)
    refused = {"type": "null", "description": "refused: no stored state, no reasoning, no prompt templates"}
    return {
        "type": "object", "required": ["input"], "additionalProperties": True,
        "description": "The rendered input's tokens and max_output_tokens must fit the context (max_model_len). "
                       "Without tools, tool_choice \"auto\" and \"none\" are text, the others refused.",
        "properties": {
            **{name: common[name] for name in ("model", "stream", "priority", "cache_salt", "user")},
            **{name: sampling[name] for name in passed},
            "input": {"anyOf": [text, {"type": "array", "items": items, "minItems": 1}]},
            "instructions": _nullable({**text, "description": "a system message first"}),
            "max_output_tokens": _nullable(_int(1)),
            "text": _nullable({"type": "object", "properties": {"format": _nullable(formats)}}),
            "tools": _nullable({"type": "array", "items": tool}),
            "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named], "description": (
                "with tools: \"required\" or a function of tools (by name), a call constrained to their schemas; "
                "\"none\": text; \"auto\" (the default): " + (
                    "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice else
                    "refused (the server runs without --enable-auto-tool-choice)"))}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            "include": _nullable({"type": "array", "items": {"enum": list(responses._INCLUDE)},
                                  "description": "message.output_text.logprobs: the output text's logprobs"}),
            "top_logprobs": _nullable(_int(0, MAX_LOGPROBS)),
            "metadata": _nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                   "additionalProperties": {"type": "string", "maxLength": 512}}),
            "store": _nullable({"type": "boolean", "description": "taken and ignored: nothing is stored"}),
            "background": _nullable({"const": False, "description": "true is refused (no stored state)"}),
            "truncation": _nullable({"enum": list(responses._TRUNCATION)}),
            "service_tier": _nullable({"enum": list(responses._SERVICE_TIERS)}),
            "max_tool_calls": _nullable(_int(0)),
            "previous_response_id": refused, "reasoning": refused, "prompt": refused, "conversation": refused,
            "chat_template_kwargs": _template_kwargs(chat_template),
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
        "type": {"const": "tool_use"}, "id": _nullable({"type": "string"}), "name": {"type": "string"},
        "input": _nullable({"type": "object"})}}
    tool_result = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
        "content": _nullable({"anyOf": [{"type": "string"}, texts]})}}
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
        "type": _nullable({"const": "custom"}), "name": {"type": "string", "minLength": 1},
        "description": _nullable({"type": "string"}),
        "input_schema": {"type": "object", "description": "a JSON schema (it must compile)"}}}
    choice = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": _nullable({"type": "string"}),
        "disable_parallel_tool_use": _nullable({"type": "boolean"})},
        "if": {"properties": {"type": {"const": "tool"}}}, "then": {"required": ["name"],
                                                                      "properties": {"name": {"type": "string"}}},
        "description": "any: a call constrained to the tools' schemas; tool: the named one's (of tools); none: text; "
                       "auto (the default with tools): " + (
                           "the model's own calls, read by the server's --tool-call-parser" if auto_tool_choice
                           else "refused (the server runs without --enable-auto-tool-choice)")}
    thinking = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive"]}}},
        {"type": "object", "required": ["type", "budget_tokens"], "properties": {
            "type": {"const": "enabled"}, "budget_tokens": {**_int(1024), "description": "below max_tokens"}}}],
        "description": "checked and ignored: the served model does not think"}
    output_config = {"type": "object", "properties": {"format": _nullable({
        "type": "object", "properties": {"type": {"const": "json_schema"}, "schema": _nullable({
            "type": "object", "description": "a JSON schema (it must compile): the answer's text follows it"})}})}}
    return {"model": model, "messages": _anthropic_messages(),
            "system": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": text}]}),
            "tools": _nullable({"type": "array", "items": tool}), "tool_choice": _nullable(choice),
            "thinking": _nullable(thinking), "output_config": _nullable(output_config)}


def _anthropic_body(model: dict, vocab_size: int | None, max_model_len: int | None, auto_tool_choice: bool = False,
                    chat_template: bool = False) -> dict:
    """``pdpool.server.anthropic_messages.translate``'s fields: its own, and those it passes on to chat."""
    sampling = _sampling(vocab_size, max_model_len)
    word = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True,
        "description": "The rendered messages' tokens and max_tokens must fit the context (max_model_len).",
        "properties": {
            **_anthropic_fields(model, auto_tool_choice),
            **{name: sampling[name] for name in ("temperature", "top_p", "top_k")},
            "max_tokens": _int(1), "stop_sequences": _nullable({"type": "array", "items": word}),
            "stream": _nullable({"type": "boolean"}), "cache_salt": _common(model)["cache_salt"],
            "metadata": _nullable({"type": "object", "properties": {"user_id": _nullable({"type": "string"})}}),
            "chat_template_kwargs": _template_kwargs(chat_template),
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


def _count_tokens_body(model: dict, chat_template: bool = False) -> dict:
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": True, "properties": {
        **_anthropic_fields(model, True), "chat_template_kwargs": _template_kwargs(chat_template)}}


def _tokenize_body(model: dict, chat_template: bool = False) -> dict:
    flags = {name: _nullable({"type": "boolean"}) for name in (
        "add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs")}
    return {"type": "object", "additionalProperties": True,
            "properties": {"model": _nullable(model), "prompt": {"type": "string"}, "messages": _messages(),
                           "chat_template": _chat_template(chat_template),
                           "chat_template_kwargs": _template_kwargs(chat_template),
                           **flags},
            # continue_final_message is read with messages only (a prompt is tokenized as it is)
            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
            "allOf": [{"if": {"required": ["messages"]}, "then": _CONTINUE_RULE}],
            "description": "prompt or messages, not both; add_special_tokens defaults to true with prompt, false "
                           "with messages"}


def _detokenize_body(model: dict, vocab_size: int | None) -> dict:
    return {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
        "model": _nullable(model), "tokens": {"type": "array", "items": _token_id(vocab_size)}}}


def spec(routes, *, title: str, served_model_names: list[str], api_key: bool, vocab_size: int | None = None,
         max_model_len: int | None = None, auto_tool_choice: bool = False, chat_template: bool = False) -> dict:
    """The document for ``routes`` (the (method, path) pairs served; others are left out). ``api_key``: whether
    the API (all but /health*, /metrics, /openapi.json) needs ``Authorization: Bearer``. ``vocab_size`` and
    ``max_model_len``, where known, bound token ids and lengths. ``auto_tool_choice``: tool_choice "auto" is
    served (--enable-auto-tool-choice). ``chat_template``: a request's is taken (--trust-request-chat-template)."""
    model = {"type": "string", "enum": list(served_model_names)}
    bodies = {"/v1/completions": _completion_body(model, vocab_size, max_model_len),
              "/v1/chat/completions": _chat_body(model, vocab_size, max_model_len, auto_tool_choice, chat_template),
              "/v1/responses": _responses_body(model, vocab_size, max_model_len, auto_tool_choice, chat_template),
              anthropic_messages.PATH: _anthropic_body(model, vocab_size, max_model_len, auto_tool_choice,
                                                       chat_template),
              anthropic_messages.COUNT_TOKENS_PATH: _count_tokens_body(model, chat_template),
              "/tokenize": _tokenize_body(model, chat_template), "/detokenize": _detokenize_body(model, vocab_size)}
    paths: dict = {}
    for method, path in sorted(set(routes)):
        summary = _DOCS.get((method, path))
        if summary is None:
            continue
        op: dict = {"summary": summary, "parameters": [
            {"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "Request id carried through and echoed back (generated if absent)."}]}
        if "{model}" in path:
            op["parameters"].append({"name": "model", "in": "path", "required": True, "schema": model,
                                     "description": "A served model name (it may hold slashes)."})
        anthropic = path.startswith(anthropic_messages.PATH)
        if path in bodies:
            op["requestBody"] = {"required": True, "content": {_JSON: {"schema": bodies[path]}}}
            errors = _GEN_ERRORS if path.startswith("/v1/") else _ERRORS
            if anthropic:
                errors = {status: {**e, "content": _ANTHROPIC_ERROR["content"]} for status, e in errors.items()}
            ok: dict = {_JSON: {"schema": {"type": "object"}}}
            if path.startswith("/v1/"):
                ok["text/event-stream"] = {"schema": {  # each event: a JSON chunk, the last one "[DONE]"
                    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}
            op["responses"] = {"200": {"description": "JSON, or server-sent events when `stream` is true"
                                       if path.startswith("/v1/") else "OK", "content": ok}, **errors}
        else:
            content_type = _PLAIN.get(path, _JSON)
            op["responses"] = {"200": {"description": "OK", "content": {content_type: {"schema": {}}}}}
            if path in _NOT_READY:
                op["responses"]["503"] = {"description": "Not ready", "content": {_JSON: {"schema": {"type": "object"}}}}
            if "{model}" in path:
                op["responses"]["404"] = _ERROR
        if api_key and not path.startswith(_PUBLIC):
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = {**(_ANTHROPIC_ERROR if anthropic else _ERROR),
                                      "description": "Missing or wrong API key"}
        paths.setdefault(path, {})[method.lower()] = op
    components: dict = {"schemas": {"Error": {
        "type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer"]}}}}},
        "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
            "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
                "type": {"type": "string"}, "message": {"type": "string"}}}}}}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths, "components": components}
